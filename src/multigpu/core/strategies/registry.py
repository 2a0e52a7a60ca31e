"""Every way of training multigpu knows, listed once: the only place strategy names appear.

Each entry is what the CLI, the doctor, the bench and the launcher need to know about a strategy
before anything is built (and before torch is imported: `--help` and usage errors answer without
it): its `--strategy` help, how many processes it runs, whether it needs GPUs, and what it allows.
The class that does the work is named by its import path and loaded when a run builds it.

Adding a strategy: a module with a `Strategy` subclass (strategies/base.py) and one entry here.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from multigpu.core.errors import UsageError

if TYPE_CHECKING:
    from multigpu.core.strategies.base import Strategy


@dataclass(frozen=True)
class StrategyInfo:
    name: str
    cls: str                      # "module:Class" of its Strategy subclass
    help: str                     # its part of `--strategy`'s help
    one_process: bool = False     # one process drives all its devices (else one process each)
    max_devices: int | None = None
    needs_gpus: bool = False
    cuda_graphs: bool = True      # --compile reduce-overhead / max-autotune can run under it
    auto_batch: bool = True       # --batch-size auto can measure it (one process per GPU)
    unused_fails: bool = False    # a parameter without a gradient breaks its next step
    channels_last: bool = True    # convnets' weights may be NHWC (FSDP2 shards only contiguous ones)
    flags: tuple[str, ...] = ()   # `multigpu train` options only this strategy reads

    def load(self) -> type[Strategy]:
        module, name = self.cls.split(":")
        return getattr(importlib.import_module(module), name)


STRATEGIES: dict[str, StrategyInfo] = {s.name: s for s in (
    StrategyInfo("single", "multigpu.core.strategies.single:SingleDevice", "one device",
                 one_process=True, max_devices=1),
    StrategyInfo("dp", "multigpu.core.strategies.dp:DataParallel",
                 "nn.DataParallel, one process", one_process=True, needs_gpus=True,
                 cuda_graphs=False, auto_batch=False),
    StrategyInfo("ddp", "multigpu.core.strategies.ddp:DDP", "one process per device, gradients "
                 "all-reduced", unused_fails=True),
    StrategyInfo("fsdp", "multigpu.core.strategies.fsdp:FSDP", "FSDP2: parameters, gradients and "
                 "optimizer state sharded over the processes, for models larger than one GPU",
                 cuda_graphs=False, auto_batch=False, channels_last=False,
                 flags=("fsdp_cpu_offload", "activation_checkpointing")),
)}
AUTO = "auto"
NAMES = (AUTO, *STRATEGIES)
HELP = (f"{AUTO} (ddp with several devices, else single) | "
        + " | ".join(f"{s.name} ({s.help})" for s in STRATEGIES.values()))


def info(name: str) -> StrategyInfo:
    """The entry of `name`; "auto" answers as ddp does (what it becomes with several devices)."""
    if name == AUTO:
        name = "ddp"
    if name not in STRATEGIES:
        raise UsageError(f"unknown strategy {name!r}: choose one of {', '.join(NAMES)}")
    return STRATEGIES[name]


def resolve(name: str, distributed: bool) -> StrategyInfo:
    """The strategy a process runs: "auto" is ddp when launched with several processes, else single."""
    if name == AUTO:
        name = "ddp" if distributed else "single"
    return info(name)
