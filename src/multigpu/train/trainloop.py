"""`multigpu train`'s run from start to end: resume, epochs, checkpoints inside and between them.

    rt = setup(...); out = the claimed run folder; job = build_job(cfg, rt)
    point = resume_point(...)                 rank 0 decides, every rank gets the same checkpoint
    for epoch in range(run.epoch, epochs + 1):
        train_epoch(..., so_far=run.position) after each optimizer step: control.after_step()
                                              may save a checkpoint (--checkpoint-every) or stop
        evaluate; scheduler.step(); save the end-of-epoch checkpoint; metrics.jsonl line

A stop (SIGTERM, SIGUSR1, Ctrl-C, the launcher gone) finishes the step in progress on every rank,
writes a checkpoint, waits until it is complete and ends with `Stopped`, naming the checkpoint.
A loss that became NaN/inf (fp32, bf16) ends the run before the next checkpoint, naming the last
good one (train_guards.TrainGuards); fp16 warns about a long run of skipped steps instead.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from multigpu.train import batchfit
from multigpu.train.data import decode_choice
from multigpu.train.settings import flagwords
from multigpu.train.rundir import folder_users, runfolder
from multigpu.launcher.rank import watchdog
from multigpu.launcher.rank.step_record import StepRecord
from multigpu.core import console
from multigpu.core.system import orphans
from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.train.rundir.runlog import RunLog
from multigpu.train.checkpoints.checkpoint_store import CheckpointStore
from multigpu.train.checkpoints.checkpointer import Checkpointer
from multigpu.train.settings.config import TrainConfig
from multigpu.train.control import Control
from multigpu.core.distributed import destroy_distributed
from multigpu.core.errors import UsageError
from multigpu.train.announce import announce_run
from multigpu.launcher.launch_failures import restart_note
from multigpu.train.models.model_names import precision_for
from multigpu.train.checkpoints.resume import restore
from multigpu.train.checkpoints.runstate import RunState, resume_point, starts_fresh
from multigpu.core.runtime import Runtime, setup
from multigpu.train.rundir.timeline import Timeline
from multigpu.train.head_start import HeadStart
from multigpu.train.cpu_placing import place_main_thread
from multigpu.core.system.cpu_placement import Placement
from multigpu.train.rundir.step_profile import StepProfile
from multigpu.train.epochs import Loop, run_epochs
from multigpu.train.training import (PREFETCH_FACTOR, Job, build_job, cudnn_autotunes, resolved_config,
                                     strategy_options)

EARLY_WORKERS_ENV = "MULTIGPU_EARLY_WORKERS"


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
    head = HeadStart.begin(cfg, on_part=clock.meanwhile, hold=True)  # imports, listing: while the group forms
    if cfg.deterministic:
        make_deterministic()
    rt = _setup(cfg, device_ids, accelerator, head)
    _say_from_rank0(rt)
    rt.stragglers.say = False  # on the epoch line instead (ranks_record)
    clock.mark("process group")
    if cudnn_autotunes(cfg, rt.device.type):
        torch.backends.cudnn.benchmark = True  # time the convolutions' algorithms at the first step
    control = Control(rt.env, cfg.checkpointing.cadence())
    # Under the launcher: hangs named; a dead launcher ends a rank at once until training begins
    # (orphans.py), then makes every rank save and stop (below).
    watchdog.start_from_env()
    placement = place_main_thread(cfg, rt)  # --cpu-placement auto: after the threads above
    out, fresh = _on_rank0(rt, lambda: _claim(cfg))
    cfg, job = _build(cfg, rt, head, out, clock, placement, fresh)  # the config with the batch size it found
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
            steps = StepRecord.from_env(rt.is_main, (run.epoch - 1) * len(job.data.train) + run.position)
            loop = Loop(cfg, rt, job, control, saver, out, log, clock, profile, steps)
            record = run_epochs(loop, run, point.state.get(schema.METRICS) if point else None)
        began = time.perf_counter()
        saver.finish()
        clock.add("checkpoints", time.perf_counter() - began)
    finally:
        _release(first_step, profile, saver, store, out, log)
    console.info(clock.summary())
    # Every rank done with its collectives before any tears down: a gloo rank that exits while a
    # peer's last exchange is in flight can abort ("terminate called without an active
    # exception", seen once in 4-process runs here).
    rt.env.barrier()
    return record


def _release(first_step, profile: StepProfile | None, saver: Checkpointer, store: CheckpointStore,
             out: Path, log: RunLog | None) -> None:
    """What a run holds, let go whether it finished, stopped or failed (`first_step`, `profile`
    and `log` are None where the run ended before it made them)."""
    if first_step is not None:
        first_step.remove()
    if profile is not None:
        profile.close()
    saver.close()
    store.release()
    folder_users.release(out)  # a caller that trains on here in this process is no other user
    if log is not None:
        log.close()  # curves.png: also of a run that stopped or failed


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


def _claim(cfg: TrainConfig) -> tuple[Path, bool]:
    """On rank 0: the run folder, claimed, and whether the run begins at its first step there."""
    out = runfolder.reserve_out(cfg)
    return out, starts_fresh(out, cfg.checkpointing.resume)


def _build(cfg: TrainConfig, rt: Runtime, head: HeadStart, out: Path, clock: Timeline,
           placement: Placement | None, fresh: bool) -> tuple[TrainConfig, Job]:
    """The run's model, data, loaders and optimizer; --batch-size auto found first (the loaders
    are built with it), --decode auto's trial planned. The config, with the batch size found.
    `fresh`: the run begins at its first step, so its loader workers start before the model
    (EARLY_WORKERS_ENV=0: at the first step, for benchmarks/startup_phases.py to compare)."""
    if cfg.input.batch_size == batchfit.AUTO:
        head.imports_done()  # it loads the data too: not while the thread imports the decoder
        found = batchfit.auto_batch_size(
            cfg, rt, _on_rank0(rt, lambda: runfolder.trained_batch_size(out, cfg.checkpointing.resume)))
        cfg = replace(cfg, input=replace(cfg.input, batch_size=found))
        clock.mark("batch size")
    early = fresh and os.environ.get(EARLY_WORKERS_ENV) != "0"
    job = build_job(cfg, rt, mark=clock.mark, head=head, decode_trial=True, placement=placement,
                    start_workers=early)
    job.decode = decode_choice.trial_for(job.data, rt, job.plan.workers, PREFETCH_FACTOR, out)
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
