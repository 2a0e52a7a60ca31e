"""`multigpu train --global-batch-size G`: the same optimizer steps on any device count.

The plan itself (the micro-batch and accumulation from the devices, an epoch's last step) is the
library's (multigpu.core.loading.global_batch, setup(global_batch_size=G)); this module says it the way
the command does: checked before the launch where the devices are known, in config.json, in the
run's first lines and in the resume line.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.core.errors import UsageError
from multigpu.core.loading.global_batch import BatchPlan, nearest_working, plan_batch
from multigpu.train.settings.config import TrainConfig

# config.json's facts of a run with a global batch (configfile.RUN_FACTS skips them in --config)
FACTS = ("micro_batch", "accumulation")


def check_before_launch(cfg: TrainConfig, devices: int) -> None:
    """A G the run's `devices` cannot make: the one line now, before any rank starts. With
    --batch-size auto the largest per-device batch is known only on the GPUs: the ranks check."""
    if cfg.optim.global_batch_size is not None and isinstance(cfg.input.batch_size, int):
        plan_batch(cfg.optim.global_batch_size, devices, cfg.input.batch_size)


def config_facts(plan: BatchPlan | None) -> dict:
    """config.json's global_batch and how this run made it (the flags stay as given: a repeat on
    another device count chooses its own)."""
    if plan is None:
        return {}
    return {"global_batch": plan.global_batch, "micro_batch": plan.micro,
            "accumulation": plan.accumulate}


def announce(plan: BatchPlan, samples: int, drop_last: bool) -> list[str]:
    """The run's lines about its global batch and each epoch's last step."""
    lines = [f"--global-batch-size {plan.global_batch}: {plan.describe()} (chosen from the "
             f"devices: the same optimizer steps on any device count); --lr is used as given"]
    full, rest = divmod(samples, plan.global_batch)
    if rest and drop_last:
        lines.append(f"last step: the last {rest} samples of each epoch's order are dropped "
                     "(--drop-last; a new order each epoch)")
    elif rest and full:
        lines.append(f"last step: the last {rest} of {samples} samples are trained with the step "
                     f"before them ({plan.global_batch + rest} samples, on any device count)")
    return lines


def resume_words(state: dict, plan: BatchPlan) -> str:
    """What the resume line adds: G kept, and how it is made now and was when saved."""
    then = state.get(schema.CONFIG) or {}
    words = f"; --global-batch-size {plan.global_batch} kept: {plan.describe()}"
    saved = then.get("micro_batch"), then.get("world_size"), then.get("accumulation")
    if then.get("global_batch") != plan.global_batch:
        return (f"; --global-batch-size {plan.global_batch}: {plan.describe()}, where the "
                f"checkpoint trained with a global batch of {then.get('global_batch')}")
    if None not in saved and tuple(saved) != (plan.micro, plan.devices, plan.accumulate):
        micro, world, accumulation = saved
        words += (f" (saved as {micro} per device x {world} devices x {accumulation} "
                  f"micro-batch{'es' if accumulation != 1 else ''})")
    return words


def on_fewer_devices(cfg: TrainConfig, command_of: Callable[[TrainConfig], list[str]]):
    """--min-devices with --global-batch-size G: for the restart on n devices (a lost one
    dropped), the command (None: the same) and what the restart line adds: G kept where n
    devices can make it, else the nearest G that they can (the smaller of two as near).
    None without a global batch."""
    g = cfg.optim.global_batch_size
    if g is None:
        return None

    def reshape(n: int) -> tuple[list[str] | None, str]:
        largest = cfg.input.batch_size
        if not isinstance(largest, int):  # --batch-size auto: the ranks check it
            return None, f"; --global-batch-size {g} kept"
        try:
            return None, f"; --global-batch-size {g} kept: {plan_batch(g, n, largest).describe()}"
        except UsageError:
            near = min(nearest_working(g, n, largest), key=lambda x: (abs(x - g), x))
        changed = replace(cfg, optim=replace(cfg.optim, global_batch_size=near))
        return command_of(changed), (f"; --global-batch-size {g} cannot be made on {n} devices: "
                                     f"{near} instead ({plan_batch(near, n, largest).describe()})")
    return reshape
