"""What a worker's start-up can do before its process group and model exist, done in a thread.

A worker's start-up is a line of waits: the process group (CUDA's start, NCCL's, the slowest
rank's arrival), then for folder: data the decoder (importing torchvision) and the listing of the
files, the model, DDP's constructor and the optimizer, each of which imports torch's compiler
(torch._dynamo: torch's Optimizer imports it with its first parameter group, so every run pays it
once, one process or many). None of the imports and listing needs
the group or the model, so `HeadStart.begin(cfg)`, called first thing in a worker, starts them in
a thread, and the run takes their results where it needs them (training.build_job): `data()`
before the model is built, `imports_done()` before the model is wrapped. An error the thread met
(a folder without class folders) is raised there, in the main thread, as if it had happened in
line: every rank reports it at the same point as before.

Two stages, because init_process_group waits for a torch._dynamo that is being imported (it
clears the compiler's caches when torch._dynamo is in sys.modules; torchvision imports it too):
until the run says `group_formed()` the thread imports only the compiler's own dependencies
(sympy, FSDP's modules from torch 2.13 on; triton with --compile), which leave torch._dynamo out; then torchvision,
the listing and torch._dynamo itself, while the model is built.
Hazard: two threads importing the same modules at once is safe in CPython only without circular
imports between them, so the run touches what the thread imports only after joining it, and the
thread imports only modules named here. The parts' times go to the `time:` line
(timeline.Timeline.meanwhile), which says what they overlapped. MULTIGPU_HEAD_START=0 leaves the
thread out (all of it in line, as before), for benchmarks/startup_phases.py to compare.

A run that starts its loader workers before its model (training.build_job) forks 15 processes
or so: a fork while this thread imports would leave the import's module locks held in every
child, by a thread that does not exist there, and a worker that imports the same module would
hang. So a HeadStart begun with `hold` stops after the data, before the compiler's import, until
the run says `release()`; `paused()` holds the run until the thread stands there (or has ended).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from multigpu.train.data import data_specs, imagefolder
from multigpu.train.settings.config import TrainConfig
from multigpu.train.training import load_run_data

COMPILER = "torch._dynamo"  # every optimizer's first add_param_group imports it, DDP and --compile too
# What torch._dynamo imports that leaves torch._dynamo itself out of sys.modules (the first
# stage); triton (GPU builds) only for --compile, whose kernels it makes
COMPILER_DEPENDENCIES = ("sympy", "torch.fx.experimental.symbolic_shapes", "torch.distributed.fsdp")


def early_modules(torch_version: str) -> tuple[str, ...]:
    """COMPILER_DEPENDENCIES that leave torch._dynamo out on this torch: torch 2.6's FSDP
    imports it (2.13's does not), so there FSDP waits for the group, with the compiler."""
    major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    if (major, minor) >= (2, 13):
        return COMPILER_DEPENDENCIES
    return tuple(m for m in COMPILER_DEPENDENCIES if m != "torch.distributed.fsdp")
OFF_ENV = "MULTIGPU_HEAD_START"


class HeadStart:
    """The thread's work for one run: `load` gives the data (None: the run loads its data itself),
    after `decoder`; `modules` are imported after it, `early` ones before the group formed.
    `spans`: (part, start, end) in time.time(), as each ends; `on_part` is called with each."""

    def __init__(self, load: Callable | None = None, modules: tuple[str, ...] = (),
                 decoder: Callable | None = None, early: tuple[str, ...] = (),
                 on_part: Callable | None = None, hold: bool = False):
        self._load, self._modules, self._decoder, self._early = load, modules, decoder, early
        self._on_part = on_part
        self.spans: list[tuple[str, float, float]] = []
        self._data = self._error = None
        self._data_ready, self._formed = threading.Event(), threading.Event()
        self._parked, self._go = threading.Event(), threading.Event()  # the stop before the compiler
        if not hold:
            self._go.set()
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="multigpu-head-start", daemon=True)

    @classmethod
    def begin(cls, cfg: TrainConfig, env=os.environ, on_part: Callable | None = None,
              hold: bool = False) -> HeadStart:
        """Started at once for `cfg`'s run (the launcher's environment says how many processes);
        `hold`: it stops before the compiler's import until `release()` (the module's docstring).
        With MULTIGPU_HEAD_START=0 it does nothing: the run does all of it in line."""
        if env.get(OFF_ENV) == "0":
            return cls()
        distributed = int(env.get("WORLD_SIZE", "1") or 1) > 1
        import torch

        modules, early = (COMPILER,), early_modules(torch.__version__)
        early += ("triton",) if cfg.compile else ()
        folder = data_specs.is_images(cfg.input.data)
        head = cls(lambda: load_run_data(cfg), modules, imagefolder.default_decoder, early, on_part, hold) \
            if folder else cls(None, modules, early=early, on_part=on_part, hold=hold)
        if not distributed:
            head._formed.set()  # no process group to wait for
        head._thread.start()
        return head

    def _run(self) -> None:
        self._import("compiler's modules", self._early)
        self._formed.wait()
        if self._cancelled:
            return
        try:
            if self._decoder is not None:
                self._timed("decoder", self._decoder)
            if self._load is not None:
                self._data = self._timed("folder listing", self._load)
        except BaseException as exc:  # noqa: BLE001 - raised again in the main thread (data())
            self._error = exc
        finally:
            self._data_ready.set()
        self._parked.set()
        self._go.wait()
        if not self._cancelled:
            self._import("compiler", self._modules)

    def _import(self, part: str, modules: tuple[str, ...]) -> None:
        """A failed import is left to the run, which says it where it imports the module."""
        def work():
            for module in modules:
                try:
                    if importlib.util.find_spec(module) is not None:
                        importlib.import_module(module)
                except BaseException:  # noqa: BLE001, S112 - see the docstring
                    continue
        if modules:
            self._timed(part, work)

    def _timed(self, part: str, work: Callable):
        began = time.time()
        try:
            return work()
        finally:
            self.spans.append((part, began, time.time()))
            if self._on_part is not None:
                self._on_part(*self.spans[-1])

    def cancel(self) -> None:
        """The run failed before its group formed: the thread ends after what it is importing,
        instead of waiting for a group that will not come."""
        self._cancelled = True
        self._formed.set()
        self._go.set()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """For the block's time the thread imports nothing (the run forks in it): it waits until
        the thread stands before the compiler's import (a HeadStart begun with `hold`) or has
        ended, and lets it go on after the block."""
        self._formed.set()  # (the run is past its group's forming, if it did not say so)
        if self._thread.is_alive():
            if self._go.is_set():  # not held: it may be importing at any time
                self._thread.join()
            else:
                self._parked.wait()
        try:
            yield
        finally:
            self.release()

    def parked(self) -> bool:
        """Whether the thread imports nothing now, nor until `release()`: held and standing
        before the compiler's import, or ended (or never started)."""
        return not self._thread.is_alive() or (self._parked.is_set() and not self._go.is_set())

    def release(self) -> None:
        """The thread may go on to the compiler's import (a HeadStart begun with `hold`)."""
        self._go.set()

    def group_formed(self) -> None:
        """The run's process group exists: the imports that would hold up its forming may begin."""
        self._formed.set()

    def data(self):
        """The data the thread loaded (None when it loads none); its error, raised here."""
        if not self.loads_data:
            return None
        self._formed.set()  # (the run is past its group's forming, if it did not say so)
        self._data_ready.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._data

    @property
    def loads_data(self) -> bool:
        return self._load is not None

    def imports_done(self) -> None:
        """Back when the thread has ended: its modules imported (or failed, to fail again where
        the run imports them)."""
        self._formed.set()
        self._go.set()
        if self._thread.is_alive():
            self._thread.join()
