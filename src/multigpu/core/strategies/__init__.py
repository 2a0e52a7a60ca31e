"""Strategies: a name ("auto", "single", "dp", "ddp", "fsdp") to a Strategy object.

registry.py lists them (without importing torch); each class lives in its own module, imported
when a run builds it. Adding a strategy means one module and one entry in registry.STRATEGIES.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from multigpu.core.strategies.registry import NAMES as STRATEGY_NAMES
from multigpu.core.strategies.registry import STRATEGIES, resolve

if TYPE_CHECKING:
    from multigpu.core.distributed import DistEnv
    from multigpu.core.strategies.base import Strategy, unwrap_model
    from multigpu.core.strategies.ddp import DDP, DDPOptions
    from multigpu.core.strategies.dp import DataParallel
    from multigpu.core.strategies.fsdp import FSDP, FSDPOptions
    from multigpu.core.strategies.single import SingleDevice

_EXPORTS = {"Strategy": "base", "unwrap_model": "base", "DDP": "ddp", "DDPOptions": "ddp",
            "DataParallel": "dp", "FSDP": "fsdp", "FSDPOptions": "fsdp", "SingleDevice": "single"}

# spelled out (not built from _EXPORTS) so that linters and type checkers can read it
__all__ = ["DDP", "DDPOptions", "DataParallel", "FSDP", "FSDPOptions", "STRATEGIES", "STRATEGY_NAMES",
           "SingleDevice", "Strategy", "make_strategy", "unwrap_model"]
assert set(__all__) == {*_EXPORTS, "STRATEGIES", "STRATEGY_NAMES", "make_strategy"}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"multigpu.core.strategies.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'multigpu.core.strategies' has no attribute {name!r}")


def make_strategy(name: str, env: DistEnv, *, device_ids: tuple[int, ...] = (),
                  options: object | None = None) -> Strategy:
    """The strategy `name` for this process. `auto` is ddp when launched with more than one
    process, otherwise single. `options`: the strategy's options object (DDPOptions for ddp,
    FSDPOptions for fsdp), or a tuple of several; those of other strategies are ignored."""
    return resolve(name, env.is_distributed).load().create(env, device_ids=device_ids,
                                                          options=options)
