"""The first lines of a `multigpu train` run, said once on rank 0: what trains on what and where,
the global batch and what it means for --lr, and each epoch's last step (trap 3)."""
from __future__ import annotations

from pathlib import Path

from multigpu.core import console
from multigpu.core.runtime import Runtime
from multigpu.train import global_batch
from multigpu.train.settings.config import TrainConfig
from multigpu.train.control import Control
from multigpu.train.checks.train_guards import global_batch_note
from multigpu.train.plan import RunPlan


def announce_run(cfg: TrainConfig, rt: Runtime, job, config: dict, control: Control, out: Path) -> None:
    """The run's first lines: what trains on what, where; the global batch; each epoch's last step."""
    console.info(f"multigpu train: {cfg.model} on {job.data.name} ({len(job.data.train)} train / "
                 f"{len(job.data.val)} val), {rt.strategy.describe()}, {rt.precision.kind}, "
                 f"global batch {config['global_batch']}, checkpoints "
                 f"{control.cadence.describe()} -> {out}")
    if rt.batch_plan is not None:  # --global-batch-size: its own lines
        for line in global_batch.announce(rt.batch_plan, len(job.data.train), cfg.input.drop_last):
            console.info(line)
        return
    _global_batch(cfg, rt, job.plan)
    _last_step(cfg, rt, len(job.data.train))


def _global_batch(cfg: TrainConfig, rt: Runtime, plan: RunPlan) -> None:
    """Once, on rank 0: a global batch larger than one device's, and what that means for --lr
    (the plan's lr is --lr as given: nothing is scaled)."""
    devices = rt.world_size * rt.strategy.devices_per_process
    note = global_batch_note(plan.global_batch // devices, devices, plan.accumulate, plan.lr,
                             lr_given=cfg.optim.lr is not None)
    if note:
        console.info(note)


def _last_step(cfg: TrainConfig, rt: Runtime, samples: int) -> None:
    """Trap 3, once on rank 0: what each epoch's last step is, when it is not a full one."""
    from multigpu.train.checks.setup_checks import last_step_finding

    said = last_step_finding(samples, cfg.input.batch_size, ranks=rt.world_size, drop_last=cfg.input.drop_last,
                             devices_per_rank=rt.strategy.devices_per_process).message
    if not said.endswith("all full"):
        console.info(f"last step: {said}")
