"""What `multigpu train` refuses before it launches anything, from the strategy registry's facts
and the devices found: more devices than a strategy can use, a strategy that needs GPUs on CPUs
(an option of another strategy is refused by StrategyConfig itself). In the command line's words
(its flags): the library's own refusals, made when a run builds the strategy, name setup()'s
arguments instead.
"""
from __future__ import annotations

from multigpu.core.errors import UsageError
from multigpu.core.strategies import registry


def check_device_count(name: str, devices: str, accelerator: str, gpu_count: int,
                       nproc: int) -> None:
    """Refuse, with the fix, a strategy that cannot run on as many devices as `--devices`
    resolved to (how many GPUs, how many processes) before anything is launched."""
    s = registry.info(name)
    if s.max_devices == 1 and gpu_count > 1:
        raise UsageError(f"--strategy {name} uses one device, but --devices {devices} gives "
                         f"{gpu_count}; pass --devices 1 (or one id like 2,), or use --strategy ddp")
    if s.max_devices == 1 and accelerator == "cpu" and nproc > 1:
        raise UsageError(f"--strategy {name} runs one process, but --devices {devices} asks for "
                         "several; use --devices cpu:1 or --strategy ddp")


def check_accelerator(name: str, accelerator: str, auto_batch: bool = False) -> None:
    """Refuse, with the fix, a strategy that needs GPUs on CPUs, and --batch-size auto
    (`auto_batch`) where it cannot measure."""
    s = registry.info(name)
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
