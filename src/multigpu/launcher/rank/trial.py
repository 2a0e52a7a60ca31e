"""A trial of a user's script for `multigpu doctor -- script.py`: what each worker sees of the
script's first optimizer steps, and how the script is stopped there.

The doctor launches the script as `multigpu run` does (multigpu.launcher.rank.worker on every device), with
TRIAL_DIR_ENV naming a folder of its own and TRIAL_STEPS_ENV the steps to run. The worker calls
`start_from_env()` before the script, which changes nothing in it and watches through torch's
global hooks:

- the outermost modules called (module forward hooks): the names of their parameters, and the
  batch each rank's model is given: the leading size of the first input, with gradients on, of
  the module that the first optimizer to step holds (or, with no step, of the first module with
  trainable parameters), not of any module called first: a transform that a Dataset applies
  (torchvision's Normalize is an nn.Module) is called before the model, on one sample;
- the DataLoaders iterated while gradients are on (training, not evaluation under no_grad): whether
  their sampler shards them over the ranks, and where the script iterates them;
- every optimizer step (the step post hook): at an optimizer's first step, its trainable
  parameters without a gradient; after the first optimizer's N-th step (or at once after a first
  step that DDP will refuse at the next forward), the peak memory, then this rank's record goes to
  <folder>/rank<R>.json, and once every rank has written its own the process ends (os._exit):
  nothing of the script after that step runs, no checkpoint, no final save, no `finally`, and its
  DataLoader workers are stopped with it.

A script that fails or ends before that has its error or its end written instead (`ended`). One
that reaches no such step within TRIAL_TIMEOUT_ENV seconds of its start (an update without
torch.optim, evaluation only, a stuck data loader, a slow first step) is stopped the same way by a
timer thread (`time_limit`), its record saying so and where the script was: a trial never runs a
script to its end.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import weakref
from pathlib import Path

TRIAL_DIR_ENV = "MULTIGPU_DOCTOR_TRIAL"
TRIAL_STEPS_ENV = "MULTIGPU_DOCTOR_STEPS"
TRIAL_TIMEOUT_ENV = "MULTIGPU_DOCTOR_TIMEOUT"  # seconds; unset or 0: no limit
PEERS_WAIT_SECONDS = 30.0  # how long a rank that finished waits for the others' records
_OURS = str(Path(os.path.abspath(__file__)).parents[2]) + os.sep  # multigpu's own files


def start_from_env() -> Trial | None:
    """In a worker that `multigpu doctor` started for a trial, install the hooks; None elsewhere."""
    folder = os.environ.get(TRIAL_DIR_ENV)
    if not folder:
        return None
    os.dup2(2, 1)  # the script's prints go to stderr: the doctor's stdout holds only its findings
    trial = Trial(Path(folder), int(os.environ.get(TRIAL_STEPS_ENV, "1") or 1),
                  timeout=float(os.environ.get(TRIAL_TIMEOUT_ENV, "0") or 0))
    trial.install()
    return trial


def record_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.json"


class Trial:
    def __init__(self, folder: Path, steps: int, timeout: float = 0.0):
        self.folder, self.steps, self.timeout = folder, max(1, steps), timeout
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.started = time.perf_counter()
        self._depth = 0
        self._tops: dict[int, weakref.ref] = {}  # the outermost modules called, by id
        self.batch: int | None = None  # the model's batch: set at the first optimizer step
        # id(outermost module) -> (its first batch with gradients on, has trainable parameters)
        self._batches: dict[int, tuple[int | None, bool]] = {}
        self.loaders: dict[int, dict] = {}
        self.unused: list[str] = []
        self.unused_fatal = False  # DDP without find_unused_parameters: the next forward fails
        self._counts: dict[int, int] = {}
        self._first: int | None = None  # the optimizer that stepped first counts the steps
        self.step_times: list[float] = []  # seconds from the start to each of its steps (the estimate)
        self._ending = threading.Lock()  # held by the first of: the last step, the end, the timer

    def install(self) -> None:
        import torch
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.utils.data import DataLoader

        self._grad_enabled = torch.is_grad_enabled
        register_module_forward_pre_hook(self._before_forward)
        register_module_forward_hook(self._after_forward, always_call=True)
        register_optimizer_step_post_hook(self._stepped)
        iterate = DataLoader.__iter__

        def __iter__(loader):  # noqa: N807 - the loader's own method, wrapped for the trial
            if torch.is_grad_enabled() and id(loader) not in self.loaders:
                self.loaders[id(loader)] = _loader_record(loader, _where())
            return iterate(loader)

        DataLoader.__iter__ = __iter__
        if self.timeout > 0:
            threading.Thread(target=self.time_limit, name="multigpu-doctor-time-limit",
                             daemon=True).start()

    # --- what the script does -------------------------------------------------------------------

    def _before_forward(self, module, args) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # DataParallel's replicas: their chunks are not the rank's batch
        if self._depth == 0:
            self._tops.setdefault(id(module), weakref.ref(module))
            if id(module) not in self._batches and self._grad_enabled():
                trainable = any(p.requires_grad for p in module.parameters())
                self._batches[id(module)] = (_leading_size(args), trainable)
        self._depth += 1

    def _after_forward(self, module, args, output) -> None:
        if threading.current_thread() is threading.main_thread():
            self._depth = max(0, self._depth - 1)

    def _stepped(self, optimizer, *_) -> None:
        key = id(optimizer)
        count = self._counts[key] = self._counts.get(key, 0) + 1
        if self._first is None:
            self._first = key
            self.batch = self._model_batch(
                {id(p) for g in optimizer.param_groups for p in g["params"]})
        if key == self._first:
            self.step_times.append(round(time.perf_counter() - self.started, 6))
        if count == 1:
            self._check_unused(optimizer)
        if self.unused_fatal or (key == self._first and count >= self.steps):
            self.finish()

    def _model_batch(self, params: set[int] | None = None) -> int | None:
        """The batch of the first outermost module called with gradients on that holds any of
        `params`; with None, that has trainable parameters (known when it was called: a script
        that ended has let its modules go)."""
        for key, (size, trainable) in list(self._batches.items()):  # a copy: the timer may ask
            if params is None:
                if trainable:
                    return size
                continue
            module = self._tops[key]()
            if module is not None and any(id(p) in params for p in module.parameters()):
                return size
        return None

    def _check_unused(self, optimizer) -> None:
        """Trainable parameters of this optimizer without a gradient at its first step (none
        when no parameter has one: an optimizer of a model outside this loss)."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        missing = [p for p in params if p.grad is None]
        if not missing or len(missing) == len(params):
            return
        names = self._parameter_names()
        for p in missing:
            name, ddp = names.get(id(p), (f"a parameter of shape {tuple(p.shape)}", None))
            self.unused.append(name)
            if ddp is not None and not (ddp.find_unused_parameters or ddp.static_graph):
                self.unused_fatal = True

    def _parameter_names(self) -> dict[int, tuple[str, object]]:
        """id(parameter) -> (its name in the model the script calls, that model's DDP or None)."""
        from torch.nn.parallel import DistributedDataParallel

        names = {}
        for ref in self._tops.values():
            top = ref()
            if top is None:
                continue
            ddp = top if isinstance(top, DistributedDataParallel) else None
            inner = top.module if ddp is not None else top
            for name, p in inner.named_parameters():
                names.setdefault(id(p), (name, ddp))
        return names

    # --- the record and the stop ----------------------------------------------------------------

    def finish(self) -> None:
        """Write this rank's record, wait for the other ranks' records, then end the process at
        once: the script does not go on past this step."""
        self._claim_the_end()
        self._write({"stopped_at": self._counts.get(self._first, 0)})
        self._stop()

    def time_limit(self) -> None:
        """The timer thread: after `timeout` seconds without the trial's last step, this rank's
        record says so (and where the script's main thread is), then the process ends as at that
        step. Every rank's timer fires: a rank waits for its peers' records, so no rank's exit
        breaks a collective another one is still in before that one has written its own."""
        time.sleep(self.timeout)
        if not self._ending.acquire(blocking=False):
            return  # the last step or the script's end came first
        self._write({"timed_out": self.timeout, "where": _main_thread_place()})
        self._stop()

    def _claim_the_end(self) -> None:
        """Called from the script's thread: when the timer has claimed the end already, this
        thread waits for the process to end (the timer ends it) instead of going on."""
        if not self._ending.acquire(blocking=False):
            threading.Event().wait()

    def _stop(self) -> None:
        deadline = time.monotonic() + PEERS_WAIT_SECONDS
        while time.monotonic() < deadline and not all(
                record_path(self.folder, r).exists() for r in range(self.world)):
            time.sleep(0.05)
        _exit_now(0)

    def ended(self, exc: BaseException | None) -> None:
        """The script ended before the trial's last step: normally (exc None, or exit 0) or with
        an error, written with where in the script it was raised. (After the timer has stopped
        the trial, an error here is only a peer gone first: the timer ends this process.)"""
        self._claim_the_end()
        done = exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0))
        error = None if done else _error_text(exc)
        self._write({"ended": True, "error": error, "error_where": None if done else _raised_at(exc)})

    def _write(self, extra: dict) -> None:
        batch = self.batch if self.batch is not None else self._model_batch()
        record = {"rank": self.rank, "world": self.world, "steps": self._counts.get(self._first, 0),
                  "seconds": round(time.perf_counter() - self.started, 2), "batch": batch,
                  "loaders": list(self.loaders.values()), "unused": self.unused,
                  "unused_fatal": self.unused_fatal, "memory": _memory(),
                  "step_times": self.step_times, **extra}
        from multigpu.core.system import fileio  # here: a worker imports this module before the script

        # whole or absent: the doctor and the peers read it
        fileio.atomic_write_text(record_path(self.folder, self.rank), json.dumps(record))


def _exit_now(code: int) -> None:
    """End this process without running anything more of the script (atexit, finally), after
    its output is out and its own children (DataLoader workers) are gone."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except ImportError:
        pass
    os._exit(code)


def _loader_record(loader, where: str | None) -> dict:
    from torch.utils.data import IterableDataset

    def size(obj) -> int | None:
        try:
            return len(obj)
        except TypeError:
            return None

    iterable = isinstance(loader.dataset, IterableDataset)
    shards = [s for s in (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None))
              if isinstance(n := (getattr(s, "num_replicas", None) or getattr(s, "num_ranks", None)), int)
              and n > 1]  # DistributedSampler, multigpu's ShardedBatchSampler, or alike
    sampler = shards[0] if shards else loader.sampler
    return {"where": where, "sampler": type(sampler).__name__, "sharded": None if iterable else bool(shards),
            "samples": None if iterable else size(loader.dataset),
            "batches": None if iterable else size(loader), "batch_size": loader.batch_size,
            "distributed": _distributed()}  # when it is read: a script's group may end first


def _distributed() -> bool:
    """Whether this rank is in a process group now (the script's own, or --auto's worker's)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _leading_size(args) -> int | None:
    import torch

    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return int(a.shape[0])
        if isinstance(a, (list, tuple)) and (n := _leading_size(a)) is not None:
            return n
        if isinstance(a, dict) and (n := _leading_size(list(a.values()))) is not None:
            return n
    return None


def _is_users(filename: str) -> bool:
    torch = sys.modules.get("torch")  # not imported here: the timer thread may ask mid-import
    lib = (os.path.dirname(os.__file__) + os.sep, _OURS) + (
        (os.path.dirname(torch.__file__) + os.sep,) if getattr(torch, "__file__", None) else ())
    return not filename.startswith(lib) and not filename.startswith("<")


def _place(filename: str, line: int) -> str:
    path = os.path.abspath(filename)
    here = os.getcwd() + os.sep
    return f"{path[len(here):] if path.startswith(here) else path}:{line}"


def _where() -> str | None:
    """file:line of the innermost frame of the user's code on the stack."""
    return _users_frame(sys._getframe(1))


def _main_thread_place() -> str | None:
    """file:line of the innermost frame of the user's code where the main thread is now."""
    return _users_frame(sys._current_frames().get(threading.main_thread().ident))


def _users_frame(frame) -> str | None:
    while frame is not None:
        if _is_users(frame.f_code.co_filename):
            return _place(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


def _raised_at(exc: BaseException) -> str | None:
    """file:line of the last frame of the user's code in the exception's traceback."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        if _is_users(tb.tb_frame.f_code.co_filename):
            found = _place(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def _error_text(exc: BaseException) -> str:
    from multigpu.core.errors import UsageError

    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(exc, UsageError):
        return first
    if isinstance(exc, SystemExit):
        return f"exit status {exc.code}"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _memory() -> dict:
    """Peak GPU memory allocated on each GPU this process used, or else its peak host memory."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        gpus = {}
        for i in range(torch.cuda.device_count()):
            peak = torch.cuda.max_memory_allocated(i)
            if peak:
                gpus[str(i)] = [peak, torch.cuda.get_device_properties(i).total_memory]
        return {"gpus": gpus}
    try:
        import resource

        return {"host": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # KiB on Linux
    except ImportError:
        return {}
