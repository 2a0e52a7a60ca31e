"""What a worker's start-up can do before its process group exists, done in a thread meanwhile.

A worker's start-up is a line of waits: the process group (every rank must have arrived, the
slowest one's imports included), then for folder: data the decoder (importing torchvision: 4.0-5.6 s
on 4 H100 ranks at once) and the listing of the files, the model, and DDP's constructor, which
imports torch's compiler (torch._dynamo, about 1 s). The imports and the listing need neither the
process group nor the model, so `HeadStart.begin(cfg)`, called first thing in a worker, starts
them in a thread, and the run takes their results where it needs them (training.build_job):
`data()` before the model is built, `imports_done()` before the model is wrapped. An error the
thread met (a folder without class folders) is raised there, in the main thread, as if it had
happened in line: every rank reports it at the same point as before.

The overlap is real where the main thread waits with the GIL released: the process group's
rendezvous (the other ranks' arrival), CUDA's start, the model's initialisation kernels.
Hazard: two threads importing the same modules at once is safe in CPython only without circular
imports between them, so the run touches what the thread imports only after joining it, and the
thread imports only modules named here. The parts' times go to the `time:` line
(timeline.Timeline.meanwhile), which says what they overlapped. MULTIGPU_HEAD_START=0 leaves the
thread out (all of it in line, as before), for benchmarks/startup_phases.py to compare.
"""
from __future__ import annotations

import functools
import importlib
import os
import threading
import time
from typing import Callable

from multigpu.core.strategies import registry
from multigpu.train import imagefolder
from multigpu.train.config import TrainConfig
from multigpu.train.training import load_run_data

# Modules a run imports on its way to the first step, named by the part of the `time:` line that
# imports them (the compiler: DDP's constructor and --compile import it).
COMPILER = "torch._dynamo"
OFF_ENV = "MULTIGPU_HEAD_START"


class HeadStart:
    """The thread's work for one run: `load` gives the data (None: the run loads its data itself),
    `modules` are imported after it. `spans`: (part, start, end) in time.time(), as each ends."""

    def __init__(self, load: Callable | None = None, modules: tuple[str, ...] = (),
                 decoder: Callable | None = None, on_part: Callable | None = None):
        self._load, self._modules, self._decoder, self._on_part = load, modules, decoder, on_part
        self.spans: list[tuple[str, float, float]] = []
        self._data = self._error = None
        self._data_ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="multigpu-head-start", daemon=True)

    @classmethod
    def begin(cls, cfg: TrainConfig, env=os.environ, on_part: Callable | None = None) -> "HeadStart":
        """Started at once for `cfg`'s run (the launcher's environment says how many processes);
        `on_part(part, start, end)` is called from the thread as each part ends. With
        MULTIGPU_HEAD_START=0 it does nothing: the run does all of it in line."""
        if env.get(OFF_ENV) == "0":
            return cls()
        modules = ()
        distributed = int(env.get("WORLD_SIZE", "1") or 1) > 1
        if cfg.compile or registry.resolve(cfg.strategy, distributed).name == "ddp":
            modules = (COMPILER,)
        folder = cfg.data.startswith("folder:")
        # the decoder is chosen (and cached) before the datasets ask for it, so timed apart
        head = cls(lambda: load_run_data(cfg), modules, imagefolder.default_decoder, on_part) \
            if folder else cls(None, modules, on_part=on_part)
        head._thread.start()
        return head

    def _run(self) -> None:
        try:
            if self._decoder is not None:
                self._timed("decoder", self._decoder)
            if self._load is not None:
                self._data = self._timed("folder listing", self._load)
        except BaseException as exc:  # noqa: BLE001 - raised again in the main thread (data())
            self._error = exc
        finally:
            self._data_ready.set()
        for module in self._modules:
            try:
                self._timed("compiler", functools.partial(importlib.import_module, module))
            except BaseException:  # noqa: BLE001 - the run's own import says it, in its place
                pass

    def _timed(self, part: str, work: Callable):
        began = time.time()
        try:
            return work()
        finally:
            self.spans.append((part, began, time.time()))
            if self._on_part is not None:
                self._on_part(*self.spans[-1])

    def data(self):
        """The data the thread loaded (None when it loads none); its error, raised here."""
        if not self.loads_data:
            return None
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
        if self._thread.is_alive():
            self._thread.join()

