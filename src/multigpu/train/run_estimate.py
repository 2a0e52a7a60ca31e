"""`multigpu train`'s estimate of its own epochs (estimate.py's line), said on rank 0 after the
first timed steps of this launch, e.g.

    estimate: ~12 s an epoch of 90 steps (training 11 s, evaluation 0.4 s), ~2 min for 10 epochs,
    0.07 CPU-hours on 2 CPU processes (from 20 measured steps, ±3 %); not in it: ...

and compared with the time the epochs took once they are all done:

    estimate: the 10 epochs took 2 min, estimated ~2 min (4 % longer than estimated)

The steps are those of the first epoch after its first few (estimate.FirstSteps: the loader's
start, the first step's own), timed by the host with one wait for the device at each end of the
window: none per step. Evaluation is guessed from the step (estimate.FORWARD_SHARE) until it is
timed; a checkpoint's pause is not known before the first one, so it is left out and said so.
The real time is that of the epochs of this launch, from the first one's start to the last one's
end: evaluation, checkpoints and metrics in it, the start-up before it not (the `time:` line says
that). A resumed run counts its first epoch whole.
"""
from __future__ import annotations

import time

from multigpu.core import console
from multigpu.train.estimate import FORWARD_SHARE, Estimate, FirstSteps, compared

LEAVES_OUT = ("start-up", "checkpoint pauses", "a first epoch's compile (--compile)")


class RunEstimate:
    def __init__(self, rt, job, epochs: int, first_epoch: int):
        import torch

        sync = (lambda: torch.cuda.synchronize(rt.device)) if rt.device.type == "cuda" else None
        self.rt, self.job, self.epochs, self.first_epoch = rt, job, epochs, first_epoch
        self.timer = FirstSteps(len(job.train_loader), sync=sync)
        self.estimate: Estimate | None = None
        self.started = time.perf_counter()

    @classmethod
    def for_run(cls, cfg, rt, job, first_epoch: int) -> RunEstimate:
        """The estimate of the epochs from `first_epoch` to the run's last."""
        return cls(rt, job, cfg.epochs - first_epoch + 1, first_epoch)

    def after_step(self, batches: int, epoch: int) -> None:
        """After each optimizer step: `batches` trained so far in `epoch`'s call."""
        if epoch != self.first_epoch or not self.timer.after(batches):
            return
        step_s = self.timer.step_s
        devices = self.rt.world_size * self.rt.strategy.devices_per_process
        self.estimate = Estimate(step_s, self.timer.spread, self.timer.measured,
                                 devices, self.rt.device.type == "cuda",
                                 batches=_full_epoch(self.job.train_loader), epochs=self.epochs,
                                 eval_s=_length(self.job.val_loader) * step_s * FORWARD_SHARE,
                                 leaves_out=LEAVES_OUT)
        console.info(f"estimate: {self.estimate.line()}")

    def done(self) -> None:
        """Every epoch trained: the comparison, on rank 0."""
        if self.estimate is not None and self.estimate.total_s:
            console.info(compared(self.estimate.total_s, time.perf_counter() - self.started, self.epochs))


def _full_epoch(loader) -> int:
    """A rank's batches in a whole epoch (len(loader) is what is left of a resumed one)."""
    plan = getattr(getattr(loader, "sampler", None), "full_plan", None)
    return len(plan) if plan is not None else len(loader)


def _length(loader) -> int:
    try:
        return len(loader)
    except TypeError:
        return 0
