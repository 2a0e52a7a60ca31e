"""Timing and memory of one prepared training step, inside a worker process.

Hazards this module handles:
- CUDA runs asynchronously: a trial is timed between two device synchronisations, never per step
  (a per-step sync or `.item()` would itself slow the step down).
- Ranks start a trial together (a barrier first), and the parent takes the slowest rank's time.
- Memory is read only on the devices the task uses: touching another GPU creates a CUDA context
  there (hundreds of MB) and would distort that GPU's figures.
- The machine drifts over minutes: comparable methods take turns, trial by trial (round robin).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from collections.abc import Callable

import torch
import torch.distributed as dist

from multigpu.bench import telemetry
from multigpu.bench.spec import Task


@dataclass
class Prepared:
    """A method ready to time: `step()` runs one training step and returns the samples it trained
    on over all ranks (host-side bookkeeping only, no device sync)."""
    step: Callable[[], int]
    devices: list[torch.device]
    info: dict = field(default_factory=dict)  # recorded in the row (precision, optimizer, ...)
    close: Callable[[], None] | None = None  # e.g. stop DataLoader workers
    # Real data (realdata.loader_prepared): takes the batches queued during the build and warm-up
    # off unused, so that timing starts from an empty input queue, then `extra_warmup` more steps
    # let the pipeline settle from there (see realdata.py: the steady state, not a prefetch burst).
    drain: Callable[[], None] | None = None
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


@dataclass
class Run:
    """One task being measured: its prepared step, and what has been measured so far.

    Memory, per device the task uses (None on CPU). With interleaving, several prepared methods
    are alive at once, and the device's counters cannot tell them apart; so:
      memory_before   allocated right before its build: what earlier tasks left, and what the
                      methods built before it in its set hold;
      peak            the whole device's peak during its own steps only: its build and warm-up,
                      then each of its trials (the peak counters are reset before each), so it
                      includes what the other live methods hold;
      held_by_others  allocated right before its first trial less its own resident memory
                      (allocated after its warm-up less memory_before): what the others held
                      while it ran, so peak - held_by_others is its own peak. Alone in its set,
                      this is memory_before.
    """
    task: Task
    prep: Prepared
    devices: list[torch.device]  # where its memory is read (prep.devices are synchronised)
    memory_before: list[int] | None
    setup_seconds: float
    warmup: int  # task.warmup + prep.extra_warmup
    seconds: list[float] = field(default_factory=list)  # per trial
    samples: list[int] = field(default_factory=list)  # per trial, over all ranks
    peak: list[int] | None = None
    resident: list[int] | None = None
    held_by_others: list[int] | None = None
    sampler: telemetry.Sampler | None = None  # NVML clocks during trials (None on CPU)
    gpu_trials: list[dict | None] = field(default_factory=list)  # per trial: telemetry.summarize

    def note_peak(self) -> None:
        """Fold the peak since the last reset into `peak`."""
        now = peak_allocated(self.devices)
        self.peak = now if self.peak is None or now is None else list(map(max, self.peak, now))


def warm_up(run: Run) -> None:
    """The warm-up steps, right after the build (real data: then its queue drained, and the steps
    after it); the synchronisation keeps their tail out of the next task's build time (its first
    copy to the device would wait for them)."""
    for _ in range(run.warmup - run.prep.extra_warmup):
        run.prep.step()
    if run.prep.drain:
        run.prep.drain()
    for _ in range(run.prep.extra_warmup):
        run.prep.step()
    synchronize(run.prep.devices)
    run.note_peak()  # the counters were reset before the build
    run.resident = _minus(allocated(run.devices), run.memory_before)


def time_trial(run: Run) -> None:
    """One trial: ranks start together (barrier), `steps` steps run without a sync between them,
    and the clock stops when the devices are done."""
    if not run.seconds:
        run.held_by_others = _minus(allocated(run.devices), run.resident)
    reset_peak(run.devices)
    barrier(run.prep.devices)  # also waits for whatever ran before (warm-up, another method)
    if run.sampler:
        run.sampler.start()
    try:
        start = time.perf_counter()
        count = 0
        for _ in range(run.task.steps):
            count += run.prep.step()
        synchronize(run.prep.devices)
        run.seconds.append(time.perf_counter() - start)
        run.samples.append(count)
    finally:  # a failed step must not leave the sampling thread running
        if run.sampler:
            run.gpu_trials.append(run.sampler.stop())
    run.note_peak()


def time_round_robin(runs: list[Run]) -> None:
    """Trial 1 of every run, then trial 2 of every run, and so on. The machine drifts over minutes
    (one DDP configuration: 12,794 img/s at the start of a sequence, 16,294 three minutes later),
    so timing one method's trials after another's would favour the later one; taking turns spreads
    the drift over all of them alike."""
    for i in range(max(r.task.trials for r in runs)):
        for run in runs:
            if i < run.task.trials:
                time_trial(run)


def _minus(a: list[int] | None, b: list[int] | None) -> list[int] | None:
    """Per device a - b, never below 0 (None where either is unknown, as on CPU)."""
    return None if a is None or b is None else [max(0, x - y) for x, y in zip(a, b)]


def reset_peak(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)


def release_memory(devices: list[torch.device]) -> None:
    """Free what the previous task left in the caching allocator and restart the peak counters."""
    gc.collect()
    for d in devices:
        if d.type == "cuda":
            with torch.cuda.device(d):
                torch.cuda.empty_cache()
    reset_peak(devices)


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
