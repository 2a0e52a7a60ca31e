"""The guards of `multigpu train`'s loop, in its words: it stops at a non-finite loss (fp32,
bf16), warns about a long run of fp16's skipped steps, and says once what a global batch larger
than one device's means for --lr, and what to try for an epoch held up by its input.

The detection is the library's (guards.py: FirstNonFinite, SkippedRun); here is where the train
loop looks, at the points where it already waits for the device (before every checkpoint and at
the end of each epoch), and what it says, naming its flags.
"""
from __future__ import annotations

from pathlib import Path

from multigpu.core import console
from multigpu.core.checkpoints.checkpoint_schema import checkpoints_folder
from multigpu.core.errors import UsageError
from multigpu.core.guards import FirstNonFinite, Found, SkippedRun, weights_finite


class NonFiniteLoss(UsageError):
    """The loss (or the weights) became NaN/inf; the message names the step, the last good
    checkpoint and the fix. The CLI prints it as one line and exits with status 2."""


def lr_text(lr: float, lr_now: float | None = None) -> str:
    """--lr's value, and the scheduler's where it made another of it."""
    if lr_now is None or abs(lr_now - lr) <= 1e-12 * max(abs(lr), 1e-30):
        return f"now {lr:g}"
    return f"now {lr:g}, {lr_now:g} at that step after --scheduler"


def nonfinite_fix(lr: float, clip_grad_norm: float | None, lr_now: float | None = None) -> str:
    """What to change when the loss became NaN/inf. `lr`: --lr; `lr_now`: the optimizer's, where
    a scheduler changed it."""
    clip = ("add --clip-grad-norm 1.0" if clip_grad_norm is None
            else f"lower --clip-grad-norm (now {clip_grad_norm:g})")
    return f"Lower --lr ({lr_text(lr, lr_now)}), {clip}, or check the data for NaN"


def nonfinite_message(found: Found, *, step: int, where: str, last_good: Path | None, out: Path,
                      fix: str) -> str:
    """The one line `multigpu train` ends with when the loss or the weights became NaN/inf
    (`fix`: nonfinite_fix's)."""
    what = ("the weights became NaN/inf (the loss was still finite)" if found.kind == "weights"
            else f"the loss became {found.kind}")
    kept = (f"the last good checkpoint is {last_good}" if last_good is not None
            else "no checkpoint was saved before it")
    if last_good is None:
        return f"{what} at step {step} ({where}); weights after it are not saved: {kept}. {fix}"
    source = out if Path(last_good).parent == checkpoints_folder(out) else last_good
    return (f"{what} at step {step} ({where}); weights after it are not saved: {kept}. {fix}; "
            f"resume from it with --resume {source}")


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
            fix=nonfinite_fix(self.lr, self.clip_grad_norm, self._lr_now())))

    def _look_at_skipped(self) -> None:
        if self.skipped is None:
            return
        precision = self.rt.precision
        if self.skipped.look(precision.skipped_steps) and self.rt.is_main:
            console.warn(skipped_run_message(self.skipped.length, precision.scaler.get_scale(),
                                             self.lr, self._lr_now()))

    def _lr_now(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


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
    said = (f"global batch {batch_size * n} ({parts}): --lr {lr:g}{given} is used as given, not "
            f"scaled, so an epoch makes {n}x fewer optimizer steps than at batch {batch_size} on "
            f"one device")
    if lr * n > LARGEST_HINTED_LR:  # no advice to go higher still: a typo is likelier
        return (f"{said}; --lr {lr:g} is far above the learning rates that train (below "
                f"{LARGEST_HINTED_LR:g} for sgd, adam and adamw): check it for a typo")
    return (f"{said}; if accuracy lags the one-device run, try --lr {lr * n:g} (linear "
            f"scaling: --lr x {n}) or more --epochs")


LARGEST_HINTED_LR = 10.0  # linear scaling is never advised past this (SGD's large-batch recipes stay under it)


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
