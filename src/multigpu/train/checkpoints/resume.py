"""A run's resumption from its resume point (runstate.resume_point): the whole state of a
checkpoint, or a model's bare weights, loaded into the job built for this run."""
from __future__ import annotations

from pathlib import Path

from multigpu.core.checkpoints import checkpoint, sharded_checkpoint
from multigpu.core import console
from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.core.errors import UsageError
from multigpu.core.loading.loaders import sample_seed
from multigpu.core.runtime import Runtime, seed_everything
from multigpu.train import global_batch
from multigpu.train.rundir import runfolder
from multigpu.train.settings.config import TrainConfig
from multigpu.train.checkpoints.runstate import ResumePoint, RunState
from multigpu.train.training import Job


def restore(cfg: TrainConfig, rt: Runtime, job: Job, point: ResumePoint, out: Path) -> RunState:
    if point.weights_only:
        return _start_from_weights(cfg, rt, job, point)
    run = point.run
    rt.load(point.state, model=job.model, optimizer=job.optimizer, scheduler=job.scheduler,
            shards_dir=sharded_checkpoint.folder_of(point.state, Path(point.path).parent))
    if len(run.rng) != rt.world_size:  # another layout: fresh streams, not those of step 0 again
        seed_everything(sample_seed(cfg.seed, run.global_step, rt.rank))
    if job.decode is not None:  # --decode auto's pick: kept, not measured again
        job.decode.load(point.state.get(schema.DECODE))
    if rt.is_main and point.in_place:
        runfolder.reconcile_metrics(out, run.completed_epochs, point.state.get(schema.METRICS))
    where = (f"epoch {run.epoch}, {run.position} of {job.train_loader.num_samples} samples in"
             if run.position else f"after epoch {run.completed_epochs}")
    console.info(f"resumed from {point.path} ({where}, step {run.global_step}; saved by "
                 f"{point.state.get(schema.WORLD_SIZE)} x {point.state.get(schema.STRATEGY)})"
                 + (global_batch.resume_words(point.state, rt.batch_plan) if rt.batch_plan else
                    batch_change(point.state, cfg.input.batch_size,
                                 cfg.input.batch_size * rt.strategy.devices_per_process * rt.world_size)))
    if run.completed_epochs >= cfg.epochs:
        console.info(f"the run is complete ({run.completed_epochs} of {cfg.epochs} epochs): nothing "
                     f"left to train; a larger --epochs trains on from here")
    return run


def batch_change(state: dict, per_device: int, now: int) -> str:
    """What the resume line adds where the global batch is not the one the checkpoint trained
    with: --batch-size is per device, so another device count changes it (and the steps of an
    epoch), while --lr stays as given."""
    then = (state.get(schema.CONFIG) or {}).get("global_batch")
    if then is None or int(then) == now:
        return ""
    return (f"; the global batch is {now} now ({per_device} per device), {then} when it was saved: "
            f"--batch-size is per device, so the device count changes it, and --lr is kept as given")


def refuse_misfit(path, state: dict, model, model_name: str, data_name: str) -> None:
    """A bare state dict whose weights do not fit `model`: one line (also the launcher's check,
    on a model built on the meta device, before any rank starts)."""
    misfit = checkpoint.weights_mismatch(model, state[schema.MODEL])
    if misfit:
        raise UsageError(f"--resume {path}: its weights do not fit --model {model_name} on "
                         f"{data_name} ({misfit}); give the --model (and --data) they were "
                         "saved from, or another file")


def _start_from_weights(cfg: TrainConfig, rt: Runtime, job: Job, point: ResumePoint) -> RunState:
    """--resume of a model's bare state dict: its weights, a fresh optimizer, epoch 1. Checked on
    every rank (each holds the same state), so a misfit is one line from every rank, not a
    load_state_dict traceback."""
    refuse_misfit(point.path, point.state, job.model, cfg.model, job.data.name)
    rt.load(point.state, model=job.model)
    console.info(f"--resume {point.path} holds weights only ({point.weights_only}): training "
                 "starts from them at epoch 1 with a fresh optimizer")
    return RunState()
