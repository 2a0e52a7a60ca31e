"""A script that shapes its tensors with its own batch size, stopped at its first training step
in one line that names the line and the way out.

In the default global-batch mode each of N processes reads batch_size / N samples of a split
DataLoader. A script that writes its batch size into a shape (`images.reshape(batch_size, -1)`
with the batch_size it gave the loader) then fails inside torch, with torch's words only:
`mat1 and mat2 shapes cannot be multiplied (100x392 and 784x256)`. --auto cannot make such a
shape right (the number is the script's), so it says why instead.

From the moment a split loader's first batch is drawn (gradients on) until the first optimizer
step, every torch call of this process goes through a TorchFunctionMode (torch's public hook on
each call): an error torch raises there that is a shape error naming the global batch size
becomes a UsageError, `multigpu: error: train.py:31: ...` (exit 2, no traceback). Only torch's
own errors are looked at, only in that window, and only in this process (the loader's workers
have started before the mode is entered); then the mode leaves torch's stack, and the steps after
run without it. A script that calls torch.compile gets no window (see install()).
"""
from __future__ import annotations

import functools
import os
import re
import sys
import sysconfig

import torch
from torch.overrides import TorchFunctionMode

from multigpu.core.errors import UsageError

_SHAPE_WORDS = re.compile(r"shape|size|dimension|mat1", re.IGNORECASE)


def names_global_batch(message: str, global_batch: int, per_process: int) -> bool:
    """Whether torch's error `message` is a shape error that has the script's global batch size
    where a split batch has `per_process` samples: `100x392`, `[100, -1]`, `batch_size (100)`."""
    if global_batch == per_process or not _SHAPE_WORDS.search(message):
        return False
    return re.search(rf"(?<![\d.]){global_batch}(?![\d.])", message) is not None


def explanation(error: str, where: str | None, global_batch: int, world_size: int) -> str:
    """The one line said instead of torch's error (`error`, raised at `where`, file:line)."""
    per = global_batch // world_size
    first = (error.strip().splitlines() or [""])[0].rstrip(".")
    return (f"{where + ': ' if where else ''}{first}, in the first training step: --auto splits "
            f"the DataLoader's batch_size={global_batch} (the global batch) over {world_size} "
            f"processes, batch_size / {world_size} = {per} samples each, and this shape has "
            f"{global_batch} where a batch has {per}; write x.size(0) or -1 where the script "
            f"uses its batch size, or run with --auto-batch per-gpu ({global_batch} per process: "
            f"a global batch of {global_batch * world_size} at the script's learning rate, "
            f"{world_size}x fewer steps per epoch)")


def library_folders() -> tuple[str, ...]:
    import multigpu

    paths = sysconfig.get_paths()
    folders = {os.path.dirname(os.__file__), os.path.dirname(torch.__file__),
               os.path.dirname(multigpu.__file__), paths["purelib"], paths["platlib"]}
    return tuple(os.path.abspath(f) + os.sep for f in folders)


def script_line(frame, ours: tuple[str, ...]) -> str | None:
    """file:line (relative to the current folder) of the innermost frame of the script's own
    code from `frame` outwards; None when there is none."""
    here = os.getcwd() + os.sep
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not frame.f_code.co_filename.startswith("<") and not path.startswith(ours):
            return f"{path[len(here):] if path.startswith(here) else path}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _in_data_loading(frame) -> bool:
    """An error of the loader's own (collating samples of different sizes) is not the script's
    shape: left as torch says it."""
    data = os.path.join(os.path.dirname(torch.__file__), "utils", "data") + os.sep
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename).startswith(data):
            return True
        frame = frame.f_back
    return False


class FirstStepShapes(TorchFunctionMode):
    """The window of the first training step: open at a split loader's first pass, closed at the
    first optimizer step."""

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.global_batch = 0
        self.state = "waiting"  # then "open", then "closed"
        self.ours = library_folders()

    def open(self, per_process: int) -> None:
        if self.state != "waiting":
            return
        self.global_batch, self.state = per_process * self.world_size, "open"
        self.__enter__()

    def close(self) -> None:
        """At the first optimizer step (one before any split pass: the window never opens).
        Popped only when the mode is the top of torch's stack (a mode the script entered in the
        step and left open would be popped instead), else left there, calling straight through."""
        was, self.state = self.state, "closed"
        if was != "open":
            return
        try:  # private (docs/torch-api.md): torch has no public look at its mode stack
            from torch.overrides import _get_current_function_mode_stack
            stack = _get_current_function_mode_stack()
            on_top = bool(stack) and stack[-1] is self
        except (ImportError, AttributeError):
            on_top = False
        if on_top:
            self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.state != "open":
            return func(*args, **(kwargs or {}))
        try:
            return func(*args, **(kwargs or {}))
        except (RuntimeError, ValueError) as exc:
            if isinstance(exc, UsageError) or not names_global_batch(
                    str(exc), self.global_batch, self.global_batch // self.world_size):
                raise
            caller = sys._getframe(1)
            if _in_data_loading(caller):
                raise
            where = script_line(caller, self.ours)
            raise UsageError(explanation(str(exc), where, self.global_batch,
                                         self.world_size)) from exc


def install(reads) -> FirstStepShapes:
    """In global-batch mode with more than one process: the window, opened by `reads`
    (training_reads.TrainingReads) and closed at the first optimizer step."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    window = FirstStepShapes(reads.world_size)
    reads.on_split.append(window.open)
    compile_ = torch.compile

    @functools.wraps(compile_)
    def compile(*args, **kwargs):  # noqa: A001 - torch's own name, wrapped
        # A script that compiles gets no window: dynamo guards on torch's mode stack, so what it
        # traced with the mode on would be compiled a second time once the mode is gone.
        if window.state == "waiting":
            window.state = "closed"
        return compile_(*args, **kwargs)

    torch.compile = compile
    # Left registered (a no-op once closed): a hook that removes itself while torch iterates
    # its hooks breaks that iteration for every hook registered after it.
    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: window.close())
    return window
