"""Runtime guards: mistakes and failures that a training loop shows only in its numbers, caught in
code and said once, with the fix.

- A non-finite loss (fp32, bf16) stops `multigpu train`. Each step only copies its loss into a
  buffer on the device (`FirstNonFinite.observe`: one small copy, no host-device sync); the loop
  searches it where it already waits for the device, before every checkpoint and at the end of
  each epoch, and the ranks agree on the first bad step together (`FirstNonFinite.agree`), so no
  checkpoint holds weights trained past it.
- fp16 does not stop (the GradScaler skips a step with inf/NaN gradients); a long run of skipped
  steps, seen at the same points from the skipped count, warns once (`SkippedRun`).
- A user loop that calls `loss.backward()` or `optimizer.step()` itself, around the Runtime,
  warns once (`Bypass`).
- A global batch larger than one device's says once that --lr is not scaled
  (`global_batch_note`).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from multigpu import console
from multigpu.checkpoint_schema import checkpoints_folder
from multigpu.errors import UsageError

NO_INDEX = 2**40  # "no bad batch": larger than any batch count, small enough to encode below
SKIPPED_RUN_STEPS = 20  # fp16: optimizer steps skipped in a row before the run is reported


class NonFiniteLoss(UsageError):
    """The loss (or the weights) became NaN/inf; the message names the step, the last good
    checkpoint and the fix. The CLI prints it as one line and exits with status 2."""


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


def lr_text(lr: float, lr_now: float | None = None) -> str:
    """--lr's value, and the scheduler's where it made another of it."""
    if lr_now is None or abs(lr_now - lr) <= 1e-12 * max(abs(lr), 1e-30):
        return f"now {lr:g}"
    return f"now {lr:g}, {lr_now:g} at that step after --scheduler"


def nonfinite_message(found: Found, *, step: int, where: str, last_good: Path | None, out: Path,
                      lr: float, clip_grad_norm: float | None, lr_now: float | None = None) -> str:
    """The one line `multigpu train` ends with when the loss or the weights became NaN/inf.
    `lr`: --lr; `lr_now`: the optimizer's, where a scheduler changed it."""
    what = ("the weights became NaN/inf (the loss was still finite)" if found.kind == "weights"
            else f"the loss became {found.kind}")
    kept = (f"the last good checkpoint is {last_good}" if last_good is not None
            else "no checkpoint was saved before it")
    clip = ("add --clip-grad-norm 1.0" if clip_grad_norm is None
            else f"lower --clip-grad-norm (now {clip_grad_norm:g})")
    fix = f"Lower --lr ({lr_text(lr, lr_now)}), {clip}, or check the data for NaN"
    if last_good is None:
        return f"{what} at step {step} ({where}); weights after it are not saved: {kept}. {fix}"
    source = out if Path(last_good).parent == checkpoints_folder(out) else last_good
    return (f"{what} at step {step} ({where}); weights after it are not saved: {kept}. {fix}; "
            f"resume from it with --resume {source}")


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
            console.warn(...)                   # once per run
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


def skipped_run_message(length: int, scale: float, lr: float, lr_now: float | None = None) -> str:
    return (f"the last {length} optimizer steps were all skipped by fp16 loss scaling (loss scale "
            f"now {scale:g}): the gradients hold inf/NaN at every scale, so the model no longer "
            "learns. The cause is NaN in the data or the model, an activation over fp16's 65504, "
            "or a learning rate too high: check the data for NaN, lower --lr "
            f"({lr_text(lr, lr_now)}) or add --clip-grad-norm 1.0, or train with --precision bf16")


# --- the guards of `multigpu train`'s loop ------------------------------------------------------

class TrainGuards:
    """What `multigpu train` checks where its loop already waits for the device: before every
    checkpoint and at each epoch's end. Every method is called on every rank at the same point.

        guards = TrainGuards(rt, optimizer, out, lr=..., clip_grad_norm=...)
        first = guards.new_epoch(epoch, base_step, batches_left, batches_per_epoch)
        ... train_epoch(..., nonfinite=first), guards.stepped() after each optimizer step
        error = guards.check(batches_done, model, last_good)   # then raise it, if any
    """

    def __init__(self, rt, optimizer, out: Path, *, lr: float, clip_grad_norm: float | None):
        self.rt, self.optimizer, self.out = rt, optimizer, out
        self.lr, self.clip_grad_norm = lr, clip_grad_norm
        fp16 = rt.precision.scaler is not None
        self.skipped = SkippedRun(rt.precision.skipped_steps) if fp16 else None
        self.first: FirstNonFinite | None = None
        # epoch, the step before this call's first batch, the epoch's batches before it, per epoch
        self._epoch = (0, 0, 0, 0)

    def new_epoch(self, epoch: int, base_step: int, batches_left: int,
                  batches_per_epoch: int) -> FirstNonFinite | None:
        """The tracker to hand to train_epoch (None for fp16, whose scaler skips bad steps)."""
        self._epoch = (epoch, base_step, batches_per_epoch - batches_left, batches_per_epoch)
        self.first = (None if self.skipped is not None
                      else FirstNonFinite(self.rt.device, capacity=batches_left))
        return self.first

    def stepped(self) -> None:
        if self.skipped is not None:
            self.skipped.stepped()

    def check(self, batches_done: int, model, last_good: Path | None) -> NonFiniteLoss | None:
        """At a sync point, before a checkpoint: the error to end the run with, or None.
        Collective; a host-device sync point. `batches_done`: batches of this epoch's call."""
        self._look_at_skipped()
        if self.first is None:
            return None
        found = self.first.agree(self.rt.env, weights_finite=weights_finite(model),
                                 now=batches_done - 1)
        if found is None:
            return None
        epoch, base, before, per_epoch = self._epoch
        where = f"epoch {epoch}, batch {before + found.index + 1} of {per_epoch}"
        return NonFiniteLoss(nonfinite_message(
            found, step=base + found.index + 1, where=where, last_good=last_good, out=self.out,
            lr=self.lr, clip_grad_norm=self.clip_grad_norm, lr_now=self._lr_now()))

    def _look_at_skipped(self) -> None:
        if self.skipped is None:
            return
        precision = self.rt.precision
        if self.skipped.look(precision.skipped_steps) and self.rt.is_main:
            console.warn(skipped_run_message(self.skipped.length, precision.scaler.get_scale(),
                                             self.lr, self._lr_now()))

    def _lr_now(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


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


# --- the global batch and the learning rate -------------------------------------------------------

def global_batch_note(batch_size: int, devices: int, accumulate: int, lr: float,
                      lr_given: bool) -> str | None:
    """What a global batch larger than one device's means for --lr, or None when it is not."""
    n = devices * accumulate
    if n <= 1:
        return None
    parts = f"{batch_size} per device x {devices} device{'s' if devices > 1 else ''}"
    if accumulate > 1:
        parts += f" x --accumulate {accumulate}"
    given = "" if lr_given else " (the default)"
    return (f"global batch {batch_size * n} ({parts}): --lr {lr:g}{given} is used as given, not "
            f"scaled, so an epoch makes {n}x fewer optimizer steps than at batch {batch_size} on "
            f"one device; if accuracy lags the one-device run, try --lr {lr * n:g} (linear "
            f"scaling: --lr x {n}) or more --epochs")


INPUT_BOUND = 0.3      # share of an epoch spent waiting for batches that earns a warning,
INPUT_BOUND_SECONDS = 1.0  # once the waiting adds up to this much (not for a job of seconds)


def input_bound(share: float, epoch_seconds: float) -> bool:
    """Whether an epoch that waited for its input `share` of its `epoch_seconds` (engine's
    input_wait) was held up by its input enough to say so."""
    return share >= INPUT_BOUND and share * epoch_seconds >= INPUT_BOUND_SECONDS


def input_bound_note(epoch: int, share: float, workers: int, *, cores: int, one_gather: bool,
                     gpu_decode_left: bool) -> str:
    """What to try for an input-bound epoch (input_bound): the loader, not the training step, set
    the pace. `cores`: the CPU cores of one training process; `one_gather`: each batch is one
    gather in the training process (timeseries: data without workers), which a larger batch makes
    cheaper per sample; `gpu_decode_left`: folder: JPEGs the loader workers decode where --decode
    gpu works."""
    fixes = ["--decode gpu (JPEGs decoded on the GPUs)"] if gpu_decode_left else []
    if one_gather:
        fixes.append("a larger --batch-size (each batch is one gather in the training process)")
    elif workers + 1 < cores:
        fixes.append(f"more --workers than {workers} per process ({cores} cores each)")
    else:
        fixes.append(f"files that cost less to read and decode (smaller images), or more CPU cores: "
                     f"the training process and its {workers} loader workers use the "
                     f"{cores} core{'s' if cores > 1 else ''} of each process already")
    return (f"epoch {epoch} waited {share:.0%} of its time for the next batch: the input, not the "
            f"training step, sets the pace; try {' or '.join(fixes)}")
