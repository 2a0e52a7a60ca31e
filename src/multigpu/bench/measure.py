"""Timing and memory of one prepared training step, inside a worker process.

Hazards this module handles:
- CUDA runs asynchronously: a trial is timed between two device synchronisations, never per step
  (a per-step sync or `.item()` would itself slow the step down).
- Ranks start a trial together (a barrier first), and the parent takes the slowest rank's time.
- Memory is read only on the devices the task uses: touching another GPU creates a CUDA context
  there (hundreds of MB) and would distort that GPU's figures.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from multigpu.bench.spec import Task


@dataclass
class Prepared:
    """A method ready to time: `step()` runs one training step and returns the samples it trained
    on over all ranks (host-side bookkeeping only, no device sync)."""
    step: Callable[[], int]
    devices: list[torch.device]
    info: dict = field(default_factory=dict)  # recorded in the row (precision, optimizer, ...)
    close: Callable[[], None] | None = None  # e.g. stop DataLoader workers
    # Steps added to the warm-up: a DataLoader fills its prefetch queue (workers x prefetch_factor
    # batches) while the GPU warms up; timing from a full queue would overstate the pipeline.
    extra_warmup: int = 0


def synthetic_batch(batch: int, task: Task, device: torch.device, channels_last: bool,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of random images, made once and left on the device (no input pipeline)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, task.image_size, task.image_size, generator=g)
    y = torch.randint(0, task.num_outputs, (batch,), generator=g)
    x = x.to(device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y.to(device)


def synchronize(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def barrier(devices: list[torch.device]) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        cuda = [d for d in devices if d.type == "cuda"]
        if dist.get_backend() == "nccl" and cuda:
            dist.barrier(device_ids=[cuda[0].index])
        else:
            dist.barrier()
    synchronize(devices)


def time_trials(prep: Prepared, warmup: int, steps: int, trials: int) -> tuple[list[float], list[int]]:
    """Warm up, then time `trials` runs of `steps` steps: (seconds, samples) per trial."""
    for _ in range(warmup):
        prep.step()
    seconds, samples = [], []
    for _ in range(trials):
        barrier(prep.devices)  # also waits for the warm-up / previous trial to finish
        start = time.perf_counter()
        count = 0
        for _ in range(steps):
            count += prep.step()
        synchronize(prep.devices)
        seconds.append(time.perf_counter() - start)
        samples.append(count)
    return seconds, samples


def release_memory(devices: list[torch.device]) -> None:
    """Free what the previous task left in the caching allocator and restart the peak counters."""
    gc.collect()
    for d in devices:
        if d.type == "cuda":
            with torch.cuda.device(d):
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(d)


def allocated(devices: list[torch.device]) -> list[int] | None:
    cuda = [d for d in devices if d.type == "cuda"]
    return [torch.cuda.memory_allocated(d) for d in cuda] or None


def peak_allocated(devices: list[torch.device]) -> list[int] | None:
    cuda = [d for d in devices if d.type == "cuda"]
    return [torch.cuda.max_memory_allocated(d) for d in cuda] or None


def describe_optimizer(optimizer) -> str:
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate/Fabric wrap the optimizer
    d = getattr(inner, "defaults", {})
    impl = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "default (foreach on CUDA)"
    return f"{type(inner).__name__} momentum={d.get('momentum')} {impl}"
