"""`multigpu train`'s estimate of its own epochs (estimate.py's line), said on rank 0 after the
first timed steps of this launch, e.g.

    estimate: ~12.4 s an epoch of 90 steps (training 11.2 s, evaluation 0.412 s, checkpoint
    0.0213 s), ~2.07 min for 10 epochs, 0.07 CPU-hours on 2 CPU processes (from 20 measured
    steps, ±3 %); not in it: ...

and compared with the time the epochs took once they are all done (a run of under 5 s is not:
its start and end outweigh its steps):

    estimate: the 10 epochs took 2.15 min, estimated ~2.07 min (4 % longer than estimated)

The steps are those of the first epoch after its first few (estimate.FirstSteps: the loader's
start, the first step's own), timed by the host with one wait for the device at each end of the
window: none per step. Right after that window rank 0 times, once, what the steps cannot show:
a few evaluation batches of the bare model (eval_batch_seconds, shared with doctor's estimate;
with --compile, a sharded model or DataParallel, whose forward on one rank alone would compile
again, wait for the others or put a whole batch on one GPU, evaluation is guessed from the step:
estimate.FORWARD_SHARE) and a checkpoint's pause (checkpoints/pause.py, shared with doctor's),
times the checkpoints an epoch holds (its end's, and --checkpoint-every's). The other ranks wait
that long for rank 0 at their next all-reduce, once. The real time is that of the epochs of this
launch, from the first one's start to the last one's end: evaluation, checkpoints and metrics in
it, the start-up before it not (the `time:` line says that). A resumed run counts its first epoch whole.
"""
from __future__ import annotations

import time

import torch

from multigpu.core import console
from multigpu.train.checkpoints.pause import checkpoint_pause
from multigpu.train.engine import prepare_inputs
from multigpu.train.estimate import FORWARD_SHARE, Estimate, FirstSteps, compared

LEAVES_OUT = ("start-up", "a first epoch's compile (--compile)")
EVAL_BATCHES = 3  # evaluation batches timed, after the loader's first (its workers' start)


class RunEstimate:
    def __init__(self, rt, job, epochs: int, first_epoch: int, *, cadence=None, writer=None,
                 compiled: bool = False):
        sync = (lambda: torch.cuda.synchronize(rt.device)) if rt.device.type == "cuda" else None
        self.rt, self.job, self.epochs, self.first_epoch = rt, job, epochs, first_epoch
        self.cadence, self.writer, self.compiled = cadence, writer, compiled
        self.timer = FirstSteps(len(job.train_loader), sync=sync)
        self.estimate: Estimate | None = None
        self.started = time.perf_counter()

    @classmethod
    def for_run(cls, cfg, rt, job, first_epoch: int, writer=None) -> RunEstimate:
        """The estimate of the epochs from `first_epoch` to the run's last; `writer`: the run's
        checkpoint writer (its snapshot buffers are the ones the pause is timed into)."""
        return cls(rt, job, cfg.epochs - first_epoch + 1, first_epoch, cadence=cfg.checkpointing.cadence(),
                   writer=writer, compiled=bool(cfg.compile))

    def after_step(self, batches: int, epoch: int) -> None:
        """After each optimizer step: `batches` trained so far in `epoch`'s call."""
        if epoch != self.first_epoch or not self.timer.after(batches) or not self.rt.is_main:
            return
        step_s, batches_an_epoch = self.timer.step_s, _full_epoch(self.job.train_loader)
        leaves = LEAVES_OUT
        eval_s = self._eval_seconds()
        if eval_s is None:
            eval_s = _length(self.job.val_loader) * step_s * FORWARD_SHARE
            leaves += ("a timed evaluation (guessed: a third of a step a batch)",)
        pause = checkpoint_pause(self.rt, self.job, self.writer)
        if pause is None:
            leaves += ("checkpoint pauses",)
        else:
            pause *= checkpoints_an_epoch(self.cadence, batches_an_epoch, step_s * batches_an_epoch)
        devices = self.rt.world_size * self.rt.strategy.devices_per_process
        self.estimate = Estimate(step_s, self.timer.spread, self.timer.measured,
                                 devices, self.rt.device.type == "cuda",
                                 batches=batches_an_epoch, epochs=self.epochs, eval_s=eval_s,
                                 checkpoint_s=pause, leaves_out=leaves)
        console.info(f"estimate: {self.estimate.line()}")

    def _eval_seconds(self) -> float | None:
        """An epoch's evaluation, from batches of the bare model on this rank; None where that
        forward differs from the run's (compiled, sharded over the ranks, or split over the GPUs
        of one process: DataParallel's whole batch would go to its first GPU)."""
        strategy = self.rt.strategy
        if (self.compiled or strategy.sharded_state or strategy.devices_per_process > 1
                or not _length(self.job.val_loader)):
            return None
        # A loader's iterator draws its seed from torch's stream: put back, the run's weights do
        # not depend on the step at which the window closed (a matter of time)
        cuda = [self.rt.device] if self.rt.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            batch = eval_batch_seconds(self.rt, self.rt.strategy.unwrap(self.job.model),
                                       self.job.val_loader, self.job.settings, self.timer.sync)
        return None if batch is None else batch * _length(self.job.val_loader)

    def done(self) -> None:
        """Every epoch trained: the comparison, on rank 0."""
        if self.estimate is not None and self.estimate.total_s:
            console.info(compared(self.estimate.total_s, time.perf_counter() - self.started, self.epochs))


def checkpoints_an_epoch(cadence, batches: int, training_s: float) -> int:
    """The checkpoints an epoch holds: its end's, and those --checkpoint-every adds inside it."""
    inside = 0
    if cadence is not None and cadence.steps:
        inside = (batches - 1) // cadence.steps
    elif cadence is not None and cadence.seconds:
        inside = int(training_s // cadence.seconds)
    return 1 + inside


@torch.no_grad()
def eval_batch_seconds(rt, model, loader, settings, sync, batches: int = EVAL_BATCHES) -> float | None:
    """Mean seconds of an evaluation batch of `model` (its fetch included), after the loader's
    first (unless it is the only one); None for an empty loader. The model is left in train mode."""
    model.eval()
    times, it = [], iter(loader)
    try:
        for _ in range(batches + 1):
            start = time.perf_counter()
            x = next(it, None)
            if x is None:
                break
            with rt.autocast():
                model(prepare_inputs(x[0], settings))
            sync()
            times.append(time.perf_counter() - start)
    finally:
        model.train()
        del it  # its workers stop here, not at the next evaluation
    times = times[1:] or times
    return sum(times) / len(times) if times else None


def _full_epoch(loader) -> int:
    """A rank's batches in a whole epoch (len(loader) is what is left of a resumed one)."""
    plan = getattr(getattr(loader, "sampler", None), "full_plan", None)
    return len(plan) if plan is not None else len(loader)


def _length(loader) -> int:
    try:
        return len(loader)
    except TypeError:
        return 0
