"""Runtime guards: mistakes and failures that a training loop shows only in its numbers, caught in
code and said once, with the fix.

- A non-finite loss (fp32, bf16): each step only copies its loss into a buffer on the device
  (`FirstNonFinite.observe`: one small copy, no host-device sync); a loop searches it where it
  already waits for the device, and the ranks agree on the first bad step together
  (`FirstNonFinite.agree`), so no checkpoint need hold weights trained past it.
- fp16 does not stop (the GradScaler skips a step with inf/NaN gradients); a long run of skipped
  steps, seen at the same points from the skipped count, is told by `SkippedRun`.
- A user loop that calls `loss.backward()` or `optimizer.step()` itself, around the Runtime,
  warns once (`Bypass`).

What `multigpu train` does with the first two, and says with its flags, is train_guards.py.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from multigpu.core import console

NO_INDEX = 2**40  # "no bad batch": larger than any batch count, small enough to encode below
SKIPPED_RUN_STEPS = 20  # fp16: optimizer steps skipped in a row before the run is reported


# --- the first non-finite loss, tracked on the device ------------------------------------------

@dataclass(frozen=True)
class Found:
    index: int  # the batch, counted from 0 where tracking began
    kind: str   # "nan", "inf", "-inf", or "weights" (the loss was finite, the weights are not)


_KINDS = ("nan", "inf", "-inf", "weights")  # a tie at one index reports the first of these


class FirstNonFinite:
    """The loss of every batch, kept on the device, and the first NaN/inf among them.

        first = FirstNonFinite(device, capacity=len(loader))
        for i, batch in enumerate(loader):
            first.observe(loss, i)        # one copy on the device: never waits for it
        found = first.agree(env)          # collective, a sync point: where the loop waits anyway

    Observing is one device-to-device copy into a preallocated buffer: about 10 us of host time
    per step on an H100 machine (6 small kernels took 60 us), and nothing is read back. The
    search runs only at `agree`, over the batches observed since the last search.
    """

    def __init__(self, device: torch.device, capacity: int = 1024):
        self.losses = torch.zeros(max(1, capacity), dtype=torch.float32, device=device)
        self._observed = 0  # batches 0.._observed-1 have their loss in `losses`
        self._searched = 0  # ... and those before this one hold no NaN/inf
        self._found: Found | None = None

    def observe(self, loss: torch.Tensor, index: int) -> None:
        """Keep batch `index`'s loss. Queued on the device: no copy to the host, no sync."""
        if index >= self.losses.numel():  # more batches than planned: grow (on the device)
            self.losses = torch.cat([self.losses, torch.zeros_like(self.losses)])
        self.losses[index] = loss.detach()
        self._observed = max(self._observed, index + 1)

    def local(self) -> Found | None:
        """This rank's first bad batch (a host-device sync point, when there is a new one)."""
        if self._found is not None or self._observed <= self._searched:
            return self._found
        part = self.losses[self._searched:self._observed]
        bad = ~torch.isfinite(part)
        first = bad.to(torch.uint8).argmax()  # the first bad one (0 when there is none)
        any_bad, at, loss = torch.stack([bad.any().double(), first.double(),
                                         part[first].double()]).tolist()  # the one sync
        if any_bad:
            kind = "nan" if loss != loss else ("inf" if loss > 0 else "-inf")
            self._found = Found(self._searched + int(at), kind)
        self._searched = self._observed
        return self._found

    def agree(self, env, *, weights_finite: bool = True, now: int = 0) -> Found | None:
        """The first bad batch over all ranks (the lowest index), or None. Collective: every rank
        calls it at the same point; a host-device sync point. `weights_finite=False` counts batch
        `now` as bad too (its update made the weights NaN/inf while its loss was finite)."""
        found = self.local()
        code = NO_INDEX * len(_KINDS)
        if found is not None:
            code = found.index * len(_KINDS) + _KINDS.index(found.kind)
        if not weights_finite:
            code = min(code, now * len(_KINDS) + _KINDS.index("weights"))
        code = -env.all_max([-code])[0]  # the minimum, exchanged on the CPU
        if code >= NO_INDEX * len(_KINDS):
            return None
        return Found(code // len(_KINDS), _KINDS[code % len(_KINDS)])


def weights_finite(module: torch.nn.Module) -> bool:
    """Whether every parameter is finite: their largest absolute values (NaN where one holds a
    NaN), in one multi-tensor kernel, then a sync point. For the moments a checkpoint copies
    every weight anyway."""
    params = [p.detach() for p in module.parameters()]
    if not params:
        return True
    return bool(torch.isfinite(torch.stack(torch._foreach_norm(params, float("inf")))).all())


# --- fp16: a long run of skipped steps ------------------------------------------------------------

class SkippedRun:
    """fp16: whether the GradScaler has skipped every optimizer step for a long while.

    Judged at the loop's sync points from the skipped count (`Precision.skipped_steps`): when it
    rose by the number of optimizer steps since the last look, every one of them was skipped.
    A look that finds a step not skipped ends the run (the steps skipped at its end are not
    counted: the look cannot tell them apart, so a run is reported late rather than wrongly).

        run = SkippedRun(rt.precision.skipped_steps)
        run.stepped()                          # after every optimizer step: a Python counter
        if run.look(rt.precision.skipped_steps):   # at a sync point
            ...                                 # say so, once per run
    """

    def __init__(self, skipped: int = 0, threshold: int = SKIPPED_RUN_STEPS):
        self.threshold = threshold
        self.length = 0        # optimizer steps skipped in a row, as far as the looks tell
        self._skipped = skipped  # the count at the last look
        self._steps = 0        # optimizer steps since the last look
        self._warned = False

    def stepped(self) -> None:
        self._steps += 1

    def look(self, skipped: int) -> bool:
        """Take in the skipped count now; True once per run, when it reaches `threshold` steps."""
        steps, rose = self._steps, skipped - self._skipped
        self._steps, self._skipped = 0, skipped
        if steps == 0:
            return False
        if rose < steps:  # some step since the last look was taken: the run, if any, is over
            self.length, self._warned = 0, False
            return False
        self.length += steps
        if self.length >= self.threshold and not self._warned:
            self._warned = True
            return True
        return False


# --- bypassing the Runtime ------------------------------------------------------------------------

BACKWARD_BYPASSED = (
    "loss.backward() was called directly, not rt.backward(loss): that skips fp16 loss scaling and "
    "the weighting that makes the gradient the mean over the optimizer step's samples (over "
    "accumulated micro-batches, which otherwise add up, and over a partial last step); call "
    "rt.backward(loss) instead")
STEP_BYPASSED = (
    "optimizer.step() was called directly, not rt.step(optimizer): that skips fp16 loss scaling "
    "(unscaling, and skipping steps whose gradients hold inf/NaN) and gradient accumulation (it "
    "steps on every micro-batch, before the gradients are synced across ranks); call "
    "rt.step(optimizer) instead")


class Bypass:
    """Trap: a loop that calls `loss.backward()` or `optimizer.step()` itself, around the
    Runtime. Each is warned once (per Runtime: one per process), on rank 0.

    `optimizer.step()`: a step pre-hook on the optimizers `rt.prepare()` passes through warns
    when the step does not come from `rt.step` (inside `stepping()`). `loss.backward()`:
    `rt.step(optimizer)` finds gradients although `rt.backward` was not called since that
    optimizer's last step (per optimizer: several may step from one backward). Neither costs
    anything on the normal path: a counter and a flag.
    """

    def __init__(self, is_main: bool):
        self.is_main = is_main
        self.backwards = 0  # rt.backward calls so far
        # optimizer -> `backwards` at its last rt.step
        self._stepped_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._in_step = False
        self._warned: set[str] = set()

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        old = getattr(optimizer, "_multigpu_step_hook", None)
        if old is not None:  # prepared again (by another Runtime): the newest one watches
            old.remove()
        optimizer._multigpu_step_hook = optimizer.register_step_pre_hook(self._before_step)

    @contextlib.contextmanager
    def stepping(self):
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def _before_step(self, optimizer, _args, _kwargs) -> None:
        if not self._in_step:
            self.warn_once("step", STEP_BYPASSED)

    def check_step(self, optimizer: torch.optim.Optimizer) -> None:
        """In rt.step, before stepping: gradients that rt.backward did not make."""
        before, self._stepped_at[optimizer] = self._stepped_at.get(optimizer, 0), self.backwards
        if before == self.backwards and any(p.grad is not None for g in optimizer.param_groups
                                            for p in g["params"]):
            self.warn_once("backward", BACKWARD_BYPASSED)

    def warn_once(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        if self.is_main:
            console.warn(message)
