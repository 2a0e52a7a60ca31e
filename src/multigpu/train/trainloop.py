"""`multigpu train`'s run from start to end: resume, epochs, checkpoints inside and between them.

    rt = setup(...); out = the claimed run folder; job = build_job(cfg, rt)
    point = resume_point(...)                 rank 0 decides, every rank gets the same checkpoint
    for epoch in range(run.epoch, epochs + 1):
        train_epoch(..., start=run.position)  after each optimizer step: control.after_step()
                                              may save a checkpoint (--checkpoint-every) or stop
        evaluate; scheduler.step(); save the end-of-epoch checkpoint; metrics.jsonl line

A stop (SIGTERM, SIGUSR1, Ctrl-C, the launcher gone) finishes the step in progress on every rank,
writes a checkpoint, waits until it is complete and ends with `Stopped`, naming the checkpoint.
A loss that became NaN/inf (fp32, bf16) ends the run before the next checkpoint, naming the last
good one (train_guards.TrainGuards); fp16 warns about a long run of skipped steps instead.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import torch

from multigpu.train import batchfit
from multigpu.train.data import data_specs, decode_choice, gpu_images
from multigpu.train.settings import flagwords
from multigpu.train.rundir import folder_users, runfolder
from multigpu.launcher.rank import watchdog
from multigpu.core import console
from multigpu.core.system import orphans
from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.train.rundir.runlog import RunLog
from multigpu.train.checkpoints.checkpoint_store import CheckpointStore
from multigpu.train.checkpoints.checkpointer import Checkpointer
from multigpu.train.settings.config import TrainConfig
from multigpu.train.control import Control
from multigpu.core.distributed import destroy_distributed, mark_failed
from multigpu.train.engine import evaluate, train_epoch
from multigpu.core.errors import Stopped, UsageError
from multigpu.train.announce import announce_run
from multigpu.train.checks.train_guards import TrainGuards, input_bound, input_bound_note
from multigpu.train.data.imagefolder import MAX_BAD_ALWAYS_ALLOWED, MAX_BAD_FRACTION
from multigpu.launcher.launch_failures import restart_note
from multigpu.core.metrics import Sums
from multigpu.train.models.model_names import precision_for
from multigpu.train.checkpoints.resume import restore
from multigpu.train.checkpoints.runstate import RunState, resume_point
from multigpu.core.runtime import Runtime, setup
from multigpu.core.stragglers import ranks_record
from multigpu.train.rundir.timeline import Timeline
from multigpu.train.head_start import HeadStart
from multigpu.train.rundir.step_profile import StepProfile
from multigpu.train.run_estimate import RunEstimate
from multigpu.train.training import (PREFETCH_FACTOR, Job, build_job, cores_per_process, learning_rate,
                                     loader_workers, oom_message, strategy_options, resolved_config)


def run_training(cfg: TrainConfig, *, device_ids: list[int] | None = None,
                 accelerator: str = "auto", launch: dict | None = None,
                 process_started: float | None = None) -> dict:
    """`launch`: provenance.launch_facts of the command that started the run (config.json);
    `process_started`: time.time() when this process's `multigpu` command began (timeline.py)."""
    record = _train(cfg, device_ids, accelerator, launch, process_started)
    destroy_distributed()  # once _train's locals, the DDP model among them, are gone: see there
    return record


def _train(cfg: TrainConfig, device_ids: list[int] | None, accelerator: str,
           launch: dict | None, process_started: float | None) -> dict:
    clock = Timeline(process=process_started,  # from the command's start, else from now
                     restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
    head = HeadStart.begin(cfg, on_part=clock.meanwhile)  # imports, listing: while the group forms
    if cfg.deterministic:
        make_deterministic()
    rt = _setup(cfg, device_ids, accelerator, head)
    _say_from_rank0(rt)
    rt.stragglers.say = False  # on the epoch line instead (ranks_record)
    clock.mark("process group")
    if rt.device.type == "cuda" and not cfg.deterministic:
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest conv kernels
    control = Control(rt.env, cfg.checkpointing.cadence())
    # Under the launcher: hangs named; a dead launcher ends a rank at once until training begins
    # (orphans.py), then makes every rank save and stop (below).
    watchdog.start_from_env()
    out = _on_rank0(rt, lambda: runfolder.reserve_out(cfg))
    cfg, job = _build(cfg, rt, head, out, clock)  # the config with the batch size it found
    config = resolved_config(cfg, rt, job, out, launch or {})
    store = CheckpointStore(schema.checkpoints_folder(out), cfg.checkpointing.keep)
    # a trained run's record is rewritten once the resumed run has trained a step, not before:
    # a resume that fails on the way (its weights do not fit) leaves the run as it was
    trained_before = rt.is_main and store.has_checkpoints() and (out / runfolder.CONFIG).is_file()
    _on_rank0(rt, lambda: (store.acquire(), None if trained_before else runfolder.write_config(out, config)))
    saver = Checkpointer(rt, job, store, config)
    clock.mark("config")
    log = first_step = None
    profile = StepProfile.from_env(out, rt)
    try:
        announce_run(cfg, rt, job, config, control, out)
        point = resume_point(rt.env, out, cfg.checkpointing.resume, cfg.checkpointing.keep)
        run = restore(cfg, rt, job, point, out) if point else RunState()
        # the last good checkpoint, until a save (a bare state dict is none to go back to)
        saver.last_path = Path(point.path) if point and not point.weights_only else None
        clock.mark("resume")
        log = RunLog.open(cfg, rt, out, config, run.global_step if point and point.in_place else None)
        control.saved(run.global_step)  # --checkpoint-every counts from here
        clock.mark_ready("logs")
        first_step = _stop_gracefully_once_trained(
            control, clock, then=(lambda: runfolder.write_config(out, config)) if trained_before else None)
        with control.signal_handlers():
            if profile is not None:
                profile.begin(run.global_step, run.epoch)  # a window from this launch's first step
            record = _epochs(cfg, rt, job, run, control, saver, out,
                             point.state.get(schema.METRICS) if point else None, log, clock, profile)
        began = time.perf_counter()
        saver.finish()
        clock.add("checkpoints", time.perf_counter() - began)
    finally:
        if first_step is not None:
            first_step.remove()
        if profile is not None:
            profile.close()
        saver.close()
        store.release()
        folder_users.release(out)  # a caller that trains on here in this process is no other user
        if log is not None:
            log.close()  # curves.png: also of a run that stopped or failed
    console.info(clock.summary())
    # Every rank done with its collectives before any tears down: a gloo rank that exits while a
    # peer's last exchange is in flight can abort ("terminate called without an active
    # exception", seen once in 4-process runs here).
    rt.env.barrier()
    return record


def _setup(cfg: TrainConfig, device_ids: list[int] | None, accelerator: str, head: HeadStart) -> Runtime:
    """The process group and the runtime; the start-up thread told when the group has formed,
    or that it will not."""
    try:
        rt = setup(cfg.parallel.strategy, precision_for(cfg.numerics.precision, cfg.model), devices=device_ids,
                   accelerator=accelerator, seed=cfg.seed, accumulate=cfg.optim.accumulate,
                   global_batch_size=cfg.optim.global_batch_size,
                   options=strategy_options(cfg), install_hooks=True)
    except BaseException:
        head.cancel()
        raise
    head.group_formed()
    return rt


def _build(cfg: TrainConfig, rt: Runtime, head: HeadStart, out: Path,
           clock: Timeline) -> tuple[TrainConfig, Job]:
    """The run's model, data, loaders and optimizer; --batch-size auto found first (the loaders
    are built with it), --decode auto's trial planned. The config, with the batch size found."""
    if cfg.input.batch_size == batchfit.AUTO:
        head.imports_done()  # it loads the data too: not while the thread imports the decoder
        found = batchfit.auto_batch_size(
            cfg, rt, _on_rank0(rt, lambda: runfolder.trained_batch_size(out, cfg.checkpointing.resume)))
        cfg = replace(cfg, input=replace(cfg.input, batch_size=found))
        clock.mark("batch size")
    job = build_job(cfg, rt, mark=clock.mark, head=head, decode_trial=True)
    job.decode = decode_choice.trial_for(job.data, rt, loader_workers(cfg, rt), PREFETCH_FACTOR, out)
    return cfg, job


def _say_from_rank0(rt: Runtime) -> None:
    """Messages from rank 0 only, from now on; a restarted launch says so first."""
    console.configure(rt.is_main, say=flagwords.say)
    if note := restart_note():
        console.warn(note)


def _stop_gracefully_once_trained(control: Control, clock: Timeline, then=None):
    """Until this launch's first optimizer step, a dead launcher ends the rank at once (orphans:
    nothing to save); from then on every rank saves and stops. The hook's handle: the run removes
    it when it ends (not the hook itself: torch is iterating over its hooks when it runs). The
    first step's time goes to the `time:` line; `then()` runs after that first step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    done = []

    def first_step(*_) -> None:
        if not done:
            done.append(True)
            clock.stepped()
            orphans.on_orphan(lambda: control.request_stop("launcher gone"))
            if then is not None:
                then()

    return register_optimizer_step_post_hook(first_step)


def make_deterministic() -> None:
    """--deterministic: the same kernels and reductions on every run. Before any CUDA work (cuBLAS
    reads its workspace setting when it starts). Kernels without a deterministic version (some
    pooling backwards on GPUs) keep running and torch warns once naming them."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _begin_epoch(job: Job, guards: TrainGuards, epoch: int, base: int, steps: int):
    """The guards' and --decode auto's trial's new epoch; the guards' first non-finite step."""
    batches = _batches_per_epoch(job.train_loader)
    first_nonfinite = guards.new_epoch(epoch, base, steps, batches)
    if job.decode is not None:
        job.decode.begin_epoch(epoch, steps, batches)
    return first_nonfinite


def _train_epoch(cfg: TrainConfig, rt: Runtime, job: Job, run: RunState, epoch: int, after_step,
                 first_nonfinite, clock: Timeline) -> dict:
    began = time.perf_counter()
    try:
        return train_epoch(rt, job.model, job.optimizer, job.loss_fn, job.train_loader,
                           job.settings, description=f"epoch {epoch}/{cfg.epochs}",
                           start=run.position, carried=(run.loss_sum, run.position, run.seconds),
                           after_step=after_step, nonfinite=first_nonfinite)
    except torch.cuda.OutOfMemoryError:
        raise UsageError(oom_message(cfg, rt)) from None
    finally:
        clock.add("training", time.perf_counter() - began)


def _epochs(cfg: TrainConfig, rt: Runtime, job: Job, run: RunState, control: Control,
            saver: Checkpointer, out: Path, last: dict | None, log: RunLog, clock: Timeline,
            profile: StepProfile | None) -> dict:
    record = {}
    first, warned_input = run.epoch, False  # the first epoch's wait includes the workers' start
    guards = TrainGuards(rt, job.optimizer, out, lr=learning_rate(cfg),
                         clip_grad_norm=cfg.optim.clip_grad_norm)
    job.train_loader.set_last_epoch(cfg.epochs - 1)  # its workers decode nothing past the run's end
    estimate = RunEstimate.for_run(cfg, rt, job, run.epoch)
    for epoch in range(run.epoch, cfg.epochs + 1):
        job.train_loader.set_epoch(epoch - 1, run.position)
        steps, base = len(job.train_loader), run.global_step
        first_nonfinite = _begin_epoch(job, guards, epoch, base, steps)

        def after_step(cursor, epoch=epoch, base=base, begun=run, last=last):
            step = base + cursor.steps
            guards.stepped()
            estimate.after_step(cursor.steps, epoch)
            if job.decode is not None:
                job.decode.after_step(cursor, rt.env)
            log.step(step, epoch, cursor, job.optimizer)
            if profile is not None:
                profile.after_step(step, cursor.waited, epoch)
            if saver.failed:
                control.request_stop("checkpoint save failed")
            decision = control.after_step(step)
            if decision is None:
                return
            _stop_if_diverged(guards, saver, cursor.steps, job.model)
            loss, _, _ = cursor.totals(rt.env)
            at = RunState(epoch, cursor.position, step, begun.loss_sum + loss,
                          begun.seconds + time.perf_counter() - cursor.start, begun.best)
            _save_or_stop(rt, saver, control, at, last, decision.stop, out)

        record = {"epoch": epoch, "step": base + steps, "lr": job.optimizer.param_groups[0]["lr"]}
        record |= _train_epoch(cfg, rt, job, run, epoch, after_step, first_nonfinite, clock)
        record |= ranks_record(rt.stragglers.take())  # each rank's own time: who held the rest back
        _stop_if_diverged(guards, saver, steps, job.model)
        _count_bad_images(rt, job, record)
        record |= _validate(cfg, rt, job, clock)
        if job.scheduler is not None:
            job.scheduler.step()
        # Regression keeps the lowest val_loss (MSE of the standardised values), not val_rmse: in
        # original units a column in large units (GDP in billions) would outweigh all the others.
        score = record["val_accuracy"] if job.classification else -record["val_loss"]
        improved = run.best is None or score > run.best
        run = RunState(epoch + 1, 0, base + steps, best=score if improved else run.best)
        # The loggers get the epoch before its checkpoint: a kill once the checkpoint is complete
        # cannot lose them (a resume from it keeps every point up to its step), one before it
        # resumes earlier and drops them (purge) to log them again.
        log.epoch(run.global_step, record)
        saver.save(run, metrics=record, best=improved)
        clock.add("checkpoints", saver.pause)
        control.saved(run.global_step)
        _report(rt, out, record, job.classification)
        log.metrics_written()
        if rt.is_main and epoch > first and not warned_input and (note := _input_note(cfg, rt, job, record)):
            console.warn(note)
            warned_input = True  # once a run
        last = record
        if epoch < cfg.epochs and (stop := control.agree_stop()):  # asked for during evaluation
            _save_or_stop(rt, saver, control, run, last, stop, out, saved=True)
    estimate.done()
    return record


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


def _save_or_stop(rt, saver, control, at: RunState, last, stop: str | None, out: Path,
                  saved: bool = False) -> None:
    """A checkpoint of `at` (unless `saved`); then, with a reason to stop, wait for it and stop."""
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
    workers = loader_workers(cfg, rt)
    gpu_decode_left = (data_specs.is_images(cfg.input.data) and not getattr(job.data.train, "on_gpu", False)
                       and gpu_images.gpu_decode_problem(rt.device) is None)
    return input_bound_note(record["epoch"], share, workers, cores=cores_per_process(rt),
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


def _on_rank0(rt: Runtime, work):
    """Run `work()` on rank 0 and give every rank its result, or its UsageError to raise."""
    result = None
    if rt.is_main:
        try:
            result = work()
        except UsageError as exc:
            result = exc
    result = rt.env.broadcast_object(result)
    if isinstance(result, UsageError):
        raise result
    return result
