"""The epochs of `multigpu train` (trainloop.py runs them): each epoch trained from the run's
position, evaluated, logged and saved; a stop asked for on the way saves and ends with `Stopped`
naming the checkpoint; a loss that became NaN/inf ends before the next checkpoint
(train_guards.TrainGuards).
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from multigpu.train.data import data_specs, gpu_images
from multigpu.train.rundir import runfolder
from multigpu.core import console
from multigpu.train.rundir.runlog import RunLog
from multigpu.train.checkpoints.checkpointer import Checkpointer
from multigpu.train.settings.config import TrainConfig
from multigpu.train.control import Control
from multigpu.core.distributed import mark_failed
from multigpu.train.engine import SoFar, evaluate, train_epoch
from multigpu.core.errors import Stopped, UsageError
from multigpu.train.checks.train_guards import TrainGuards, input_bound, input_bound_note
from multigpu.train.data.imagefolder import MAX_BAD_ALWAYS_ALLOWED, MAX_BAD_FRACTION
from multigpu.core.metrics import Sums
from multigpu.train.checkpoints.runstate import RunState
from multigpu.core.runtime import Runtime
from multigpu.core.stragglers import ranks_record
from multigpu.train.rundir.timeline import Timeline
from multigpu.train.rundir.step_profile import StepProfile
from multigpu.launcher.rank.step_record import StepRecord
from multigpu.train.run_estimate import RunEstimate
from multigpu.train.training import Job, cores_per_process, oom_message



def _begin_epoch(job: Job, guards: TrainGuards, epoch: int, base: int, steps: int):
    """The guards' and --decode auto's trial's new epoch; the guards' first non-finite step."""
    batches = _batches_per_epoch(job.train_loader)
    first_nonfinite = guards.new_epoch(epoch, base, steps, batches)
    if job.decode is not None:
        job.decode.begin_epoch(epoch, steps, batches)
    return first_nonfinite


@dataclass(frozen=True)
class Loop:
    """What the epochs run with, built once before the first: the loop's state beside the run's
    own position (RunState), which each step moves on."""
    cfg: TrainConfig
    rt: Runtime
    job: Job
    control: Control
    saver: Checkpointer
    out: Path
    log: RunLog
    clock: Timeline
    profile: StepProfile | None
    steps: StepRecord | None = None  # rank 0 under the launcher: where this attempt got to


def _train_epoch(loop: Loop, run: RunState, epoch: int, after_step, first_nonfinite) -> dict:
    cfg, rt, job, clock = loop.cfg, loop.rt, loop.job, loop.clock
    began = time.perf_counter()
    try:
        return train_epoch(rt, job, job.train_loader, description=f"epoch {epoch}/{cfg.epochs}",
                           so_far=SoFar(run.position, run.loss_sum, run.position, run.seconds),
                           after_step=after_step, nonfinite=first_nonfinite)
    except torch.cuda.OutOfMemoryError:
        raise UsageError(oom_message(cfg, rt)) from None
    finally:
        clock.add("training", time.perf_counter() - began)


def run_epochs(loop: Loop, run: RunState, last: dict | None) -> dict:
    """The epochs from `run`'s position to the run's end: each trained, evaluated, logged and
    saved; a stop asked for on the way ends it with `Stopped` (_save_or_stop). The last record."""
    cfg, rt, job, control, saver, out, log, clock = (
        loop.cfg, loop.rt, loop.job, loop.control, loop.saver, loop.out, loop.log, loop.clock)
    record = {}
    first, warned_input = run.epoch, False  # the first epoch's wait includes the workers' start
    guards = TrainGuards(rt, job.optimizer, out, lr=job.plan.lr,
                         clip_grad_norm=cfg.optim.clip_grad_norm)
    job.train_loader.set_last_epoch(cfg.epochs - 1)  # its workers decode nothing past the run's end
    estimate = RunEstimate.for_run(cfg, rt, job, run.epoch, writer=saver.writer)
    for epoch in range(run.epoch, cfg.epochs + 1):
        job.train_loader.set_epoch(epoch - 1, run.position)
        steps, base = len(job.train_loader), run.global_step
        first_nonfinite = _begin_epoch(job, guards, epoch, base, steps)

        def after_step(cursor, epoch=epoch, base=base, begun=run, last=last):
            step = base + cursor.steps
            if clock.first_step is not None:  # (a step GradScaler skipped is not the first)
                clock.waited_first(cursor.waited)  # the time: line's wait for the first step's data
            guards.stepped()
            estimate.after_step(cursor.steps, epoch)
            if job.decode is not None:
                job.decode.after_step(cursor, rt.env)
            log.step(step, epoch, cursor, job.optimizer)
            if loop.profile is not None:
                loop.profile.after_step(step, cursor.waited, epoch)
            if loop.steps is not None:
                loop.steps.stepped((epoch - 1) * len(job.data.train) + cursor.position)
            if saver.failed:
                control.request_stop("checkpoint save failed")
            decision = control.after_step(step)
            if decision is None:
                return
            _stop_if_diverged(guards, saver, cursor.steps, job.model)
            loss, _, _ = cursor.totals(rt.env)
            at = RunState(epoch, cursor.position, step, begun.loss_sum + loss,
                          begun.seconds + time.perf_counter() - cursor.start, begun.best)
            _save_or_stop(loop, at, last, decision.stop)

        record = {"epoch": epoch, "step": base + steps, "lr": job.optimizer.param_groups[0]["lr"]}
        record |= _train_epoch(loop, run, epoch, after_step, first_nonfinite)
        record |= ranks_record(rt.stragglers.take())  # each rank's own time: who held the rest back
        _stop_if_diverged(guards, saver, steps, job.model)
        _count_bad_images(rt, job, record)
        record |= _validate(cfg, rt, job, clock)
        run = _close_epoch(loop, run, record, epoch, base + steps)
        if rt.is_main and epoch > first and not warned_input and (note := _input_note(cfg, rt, job, record)):
            console.warn(note)
            warned_input = True  # once a run
        last = record
        if epoch < cfg.epochs and (stop := control.agree_stop()):  # asked for during evaluation
            _save_or_stop(loop, run, last, stop, saved=True)
    estimate.done()
    return record


def _close_epoch(loop: Loop, run: RunState, record: dict, epoch: int, step: int) -> RunState:
    """An epoch trained and evaluated: the scheduler stepped, the record logged, saved and
    reported. The run's position after it, its best score kept."""
    job, log, saver = loop.job, loop.log, loop.saver
    if job.scheduler is not None:
        job.scheduler.step()
    # Regression keeps the lowest val_loss (MSE of the standardised values), not val_rmse: in
    # original units a column in large units (GDP in billions) would outweigh all the others.
    score = record["val_accuracy"] if job.classification else -record["val_loss"]
    improved = run.best is None or score > run.best
    run = RunState(epoch + 1, 0, step, best=score if improved else run.best)
    # The loggers get the epoch before its checkpoint: a kill once the checkpoint is complete
    # cannot lose them (a resume from it keeps every point up to its step), one before it
    # resumes earlier and drops them (purge) to log them again.
    log.epoch(run.global_step, record)
    saver.save(run, metrics=record, best=improved)
    loop.clock.add("checkpoints", saver.pause)
    loop.control.saved(run.global_step)
    _report(loop.rt, loop.out, record, job.classification)
    log.metrics_written()
    return run


def _validate(cfg: TrainConfig, rt: Runtime, job: Job, clock: Timeline) -> dict:
    """The end of an epoch's training: validation metrics of rank 0's model, and the epoch's
    figures of the precision and the GPU memory."""
    rt.sync_buffers(job.model)  # every rank evaluates rank 0's model, the one saved next
    scale, began = job.data.target_scale, time.perf_counter()
    try:  # validation decodes and runs its own batches: it can run out of memory too
        record = evaluate(rt, job.model, job.loss_fn, job.val_loader, job.classification,
                          job.settings, target_std=scale[1] if scale is not None else None)
    except torch.cuda.OutOfMemoryError:
        raise UsageError(oom_message(cfg, rt)) from None
    clock.add("evaluating", time.perf_counter() - began)
    if rt.precision.scaler is not None:
        record["skipped_steps"] = rt.precision.skipped_steps
    if rt.device.type == "cuda":  # rank 0's peak of the epoch
        record["max_memory_gib"] = torch.cuda.max_memory_allocated(rt.device) / 2**30
        torch.cuda.reset_peak_memory_stats(rt.device)
    return record


def _batches_per_epoch(loader) -> int:
    return len(loader.sampler.full_plan)  # len(loader) is what is left of a resumed epoch


def _stop_if_diverged(guards: TrainGuards, saver: Checkpointer, batches_done: int, model) -> None:
    """Before a checkpoint (collective, a sync point): end the run if the loss or the weights
    became NaN/inf since the last look, once the last good checkpoint is complete on disk."""
    error = guards.check(batches_done, model, saver.last_path)
    if error is not None:
        saver.finish()
        raise error


def _save_or_stop(loop: Loop, at: RunState, last, stop: str | None, saved: bool = False) -> None:
    """A checkpoint of `at` (unless `saved`); then, with a reason to stop, wait for it and stop."""
    saver, control, out = loop.saver, loop.control, loop.out
    if stop == "checkpoint save failed":
        saver.finish()  # raises rank 0's error on every rank
    path = saver.last_path if saved else saver.save(at, metrics=last, best=False, wait=bool(stop))
    control.saved(at.global_step)
    if not saved:
        console.info(f"checkpoint {path.name}: epoch {at.epoch}, {at.position} samples in, "
                     f"training paused {saver.pause * 1e3:.0f} ms")
    if stop:
        saver.finish()
        if stop == "launcher gone":
            mark_failed()  # its rendezvous store is gone too: do not meet there before exiting
        why = f"by {stop}" if stop.startswith("SIG") else f"({stop})"
        where = (f"in epoch {at.epoch}, {at.position} samples in" if at.position
                 else f"after epoch {at.completed_epochs}")  # as a resume says it
        raise Stopped(f"stopped {why} {where}, step {at.global_step}: checkpoint "
                      f"{path} is complete; run the same command with --resume {out} to go on",
                      exit_code=_exit_code(stop))


def _exit_code(reason: str) -> int:
    sig = getattr(signal, reason, None) if reason.startswith("SIG") else None
    return 128 + int(sig) if sig is not None else 1


def _count_bad_images(rt: Runtime, job: Job, record: dict) -> None:
    """folder: data: how many unreadable images the epoch met, over all ranks (in `record`); the
    run stops when they are over 10 and over 1 % of its samples."""
    dataset = job.train_loader.dataset
    if not hasattr(dataset, "take_bad_count"):
        return
    sums = Sums(rt.env)
    sums.add(bad=dataset.take_bad_count(record["epoch"] - 1))
    record["bad_images"] = int(sums.reduce()["bad"])
    if record["bad_images"] > max(MAX_BAD_ALWAYS_ALLOWED, MAX_BAD_FRACTION * record["train_samples"]):
        raise UsageError(f"{record['bad_images']} of the {record['train_samples']} images of epoch "
                         f"{record['epoch']} could not be read (over {MAX_BAD_FRACTION:.0%}): the "
                         "data looks broken; the files are named in the warnings above and in "
                         "the rank logs")
    if record["bad_images"]:  # every rank's count, on rank 0's console: it may have met none
        n = record["bad_images"]
        console.warn(f"epoch {record['epoch']}: {n} unreadable image{'s' if n > 1 else ''} skipped, "
                     "each replaced by the next readable one (named where met; every rank's "
                     "warnings are in the run's logs/)")


def _input_note(cfg: TrainConfig, rt: Runtime, job: Job, record: dict) -> str | None:
    """The warning for an epoch held up by its input (train_guards.input_bound), or None."""
    share = record["input_wait"]
    if not input_bound(share, record["epoch_seconds"]):
        return None
    workers = job.plan.workers
    gpu_decode_left = (data_specs.is_images(cfg.input.data) and not getattr(job.data.train, "on_gpu", False)
                       and gpu_images.gpu_decode_problem(rt.device) is None)
    return input_bound_note(record["epoch"], share, workers, cores=cores_per_process(rt, job.placement),
                            gpu_decode_left=gpu_decode_left,
                            one_gather=cfg.input.data.startswith("timeseries:") and workers == 0)


def _report(rt: Runtime, out: Path, record: dict, classification: bool) -> None:
    if not rt.is_main:
        return
    runfolder.append_metrics(out, record)
    acc = f"  val_acc {record['val_accuracy']:.2%}" if classification else ""
    if "val_mae" in record:
        acc = f"  val_mae {record['val_mae']:.4g}  val_rmse {record['val_rmse']:.4g}"
    console.info(f"epoch {record['epoch']}  train_loss {record['train_loss']:.4f}  "
                 f"val_loss {record['val_loss']:.4f}{acc}  "
                 f"({record['train_samples']} train / {record['val_samples']} val samples)  "
                 f"{record['epoch_seconds']:.1f} s  {record['samples_per_second']:,.0f} samples/s"
                 f"{_wait_text(record['input_wait'])}{'; ' + record['straggler'] if 'straggler' in record else ''}")


def _wait_text(share: float) -> str:
    return f"  {share:.0%} waiting for data" if share >= 0.01 else ""
