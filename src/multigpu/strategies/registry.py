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

from multigpu.errors import UsageError

if TYPE_CHECKING:
    from multigpu.strategies.base import Strategy


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

    def load(self) -> type["Strategy"]:
        module, name = self.cls.split(":")
        return getattr(importlib.import_module(module), name)


STRATEGIES: dict[str, StrategyInfo] = {s.name: s for s in (
    StrategyInfo("single", "multigpu.strategies.single:SingleDevice", "one device",
                 one_process=True, max_devices=1),
    StrategyInfo("dp", "multigpu.strategies.dp:DataParallel",
                 "nn.DataParallel, one process", one_process=True, needs_gpus=True,
                 cuda_graphs=False, auto_batch=False),
    StrategyInfo("ddp", "multigpu.strategies.ddp:DDP", "one process per device, gradients "
                 "all-reduced", unused_fails=True),
    StrategyInfo("fsdp", "multigpu.strategies.fsdp:FSDP", "FSDP2: parameters, gradients and "
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


def check_flags(name: str, given: set[str]) -> None:
    """Refuse an option of one strategy (a TrainConfig field name in `given`) with another."""
    own = info(name).flags
    for flag in sorted(given):
        owners = [s.name for s in STRATEGIES.values() if flag in s.flags]
        if owners and flag not in own:
            option = "--" + flag.replace("_", "-")
            raise UsageError(f"{option} is an option of --strategy {owners[0]}, not of "
                             f"--strategy {name}; add --strategy {owners[0]}, or leave it out")


def check_device_count(name: str, devices: str, accelerator: str, gpu_count: int,
                       nproc: int) -> None:
    """Refuse, with the fix, a strategy that cannot run on as many devices as `--devices`
    resolved to (how many GPUs, how many processes) before anything is launched."""
    s = info(name)
    if s.max_devices == 1 and gpu_count > 1:
        raise UsageError(f"--strategy {name} uses one device, but --devices {devices} gives "
                         f"{gpu_count}; pass --devices 1 (or one id like 2,), or use --strategy ddp")
    if s.max_devices == 1 and accelerator == "cpu" and nproc > 1:
        raise UsageError(f"--strategy {name} runs one process, but --devices {devices} asks for "
                         "several; use --devices cpu:1 or --strategy ddp")


def check_accelerator(name: str, accelerator: str, auto_batch: bool = False) -> None:
    """Refuse, with the fix, a strategy that needs GPUs on CPUs, and --batch-size auto
    (`auto_batch`) where it cannot measure."""
    s = info(name)
    if auto_batch and accelerator != "cuda":
        raise UsageError("--batch-size auto measures each GPU's memory with real steps, one "
                         "process per GPU; with CPU processes give a number, e.g. --batch-size 64")
    if auto_batch and not s.auto_batch:
        why = ("one process per GPU, and --strategy dp drives several from one" if s.one_process
               else f"the whole model on one GPU, and --strategy {name} shares it out over all")
        raise UsageError(f"--batch-size auto measures with real steps of {why}; give a number, "
                         "e.g. --batch-size 64")
    if s.needs_gpus and accelerator != "cuda":
        raise UsageError(f"--strategy {name} ({s.help}) needs GPUs; on CPU use --strategy ddp "
                         "with --devices cpu:N")
