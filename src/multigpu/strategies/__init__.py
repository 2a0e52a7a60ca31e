"""Strategy registry: a name ("auto", "single", "dp", "ddp") to a Strategy object.

Adding a strategy (FSDP later) means one module and one entry in `STRATEGIES`.
"""
from __future__ import annotations

from multigpu.distributed import DistEnv
from multigpu.errors import UsageError
from multigpu.strategies.base import Strategy, unwrap_model
from multigpu.strategies.ddp import DDP, DDPOptions
from multigpu.strategies.dp import DataParallel
from multigpu.strategies.single import SingleDevice

STRATEGIES = {"single": SingleDevice, "dp": DataParallel, "ddp": DDP}
STRATEGY_NAMES = ("auto", *STRATEGIES)

__all__ = ["Strategy", "SingleDevice", "DataParallel", "DDP", "DDPOptions", "STRATEGIES",
           "STRATEGY_NAMES", "make_strategy", "unwrap_model"]


def make_strategy(name: str, env: DistEnv, *, device_ids: tuple[int, ...] = (),
                  ddp_options: DDPOptions | None = None) -> Strategy:
    """`auto` is ddp when launched with more than one process, otherwise single."""
    if name == "auto":
        name = "ddp" if env.is_distributed else "single"
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGY_NAMES)}")
    if name == "single" and env.is_distributed:
        raise UsageError(f"strategy 'single' was asked for, but {env.world_size} processes were "
                         "launched; use --strategy ddp (or auto), or launch one process")
    if name == "dp":
        return DataParallel(env, device_ids)
    if name == "ddp":
        return DDP(env, ddp_options)
    return SingleDevice(env)
