"""The training step, epoch and evaluation used by `multigpu train` and `multigpu bench` alike.

Everything here goes through the Runtime, so the same code runs on one device, DataParallel and DDP.
The loop holds no host-device sync except where the progress bar is redrawn and at the epoch's end.
A non-finite loss is only recorded on the device here (guards.FirstNonFinite); `multigpu train`
looks at it where it waits anyway, before a checkpoint and at the epoch's end.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from collections.abc import Callable

import torch
from torch import nn

from multigpu.core import compiling
from multigpu.core.console import EpochProgress
from multigpu.core.guards import FirstNonFinite
from multigpu.core.metrics import Sums, correct_count
from multigpu.core.runtime import Runtime

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepSettings:
    clip_grad_norm: float | None = None
    channels_last: bool = False  # convnets on GPUs: NHWC inputs to match the NHWC weights
    # uint8 images are normalised here, on the device: x / 255 - mean) / std, per channel.
    mean: torch.Tensor | None = None  # (1, C, 1, 1) in units of the uint8 pixel, on the device
    std: torch.Tensor | None = None

    @classmethod
    def for_data(cls, normalize, device: torch.device, **kwargs) -> StepSettings:
        if normalize is None:
            return cls(**kwargs)
        mean, std = (torch.tensor(v, device=device).mul(255).view(1, -1, 1, 1) for v in normalize)
        return cls(mean=mean, std=std, **kwargs)


def prepare_inputs(x: torch.Tensor, settings: StepSettings) -> torch.Tensor:
    if settings.channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    if x.dtype == torch.uint8 and settings.mean is not None:
        x = (x.float() - settings.mean) / settings.std
    return x


def train_step(rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn,
               batch, settings: StepSettings) -> torch.Tensor:
    """Forward, backward and optimizer step for one (micro-)batch; returns the detached loss."""
    x, y = batch
    x = prepare_inputs(x, settings)
    compiling.begin_step(model)
    with rt.autocast():
        out = model(x)
    loss = loss_fn(out.float(), y)  # the loss in fp32, whatever the autocast dtype
    rt.backward(loss)
    rt.step(optimizer, clip_grad_norm=settings.clip_grad_norm)
    return loss.detach()


@dataclass
class EpochCursor:
    """Where an epoch in progress stands, after an optimizer step (see `train_epoch`)."""
    position: int        # samples of the epoch's order trained so far, over all ranks
    steps: int           # batches trained in this call
    loss_sum: torch.Tensor  # this rank's loss summed over its samples in this call (on the device)
    local_samples: int   # this rank's samples in this call
    start: float         # perf_counter() when this call began
    begin: int = 0       # the position this call began at
    waited: float = 0.0  # seconds this rank's loop waited for its next batch in this call

    def totals(self, env) -> tuple[float, int, float]:
        """(loss sum, samples, seconds waited for input) of this call over all ranks. A
        collective and a sync point."""
        sums = Sums(env)
        sums.add(loss_sum=self.loss_sum, samples=self.local_samples, waited=self.waited)
        t = sums.reduce()
        return t["loss_sum"], int(t["samples"]), t["waited"]


def _timed(loader, cursor: EpochCursor):
    """The loader's batches; the host's time spent getting each one (starting the iterator
    included) is added to cursor.waited. The step runs ahead of the GPU, so the host waits here
    only where the input, not the GPU, sets the pace (a host-side gather counts too)."""
    began = time.perf_counter()
    for batch in loader:
        cursor.waited += time.perf_counter() - began
        yield batch
        began = time.perf_counter()


@dataclass(frozen=True)
class StepParts:
    """What a training step works on. `multigpu train`'s Job has the same four attributes and is
    passed as it is."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: LossFn
    settings: StepSettings


@dataclass(frozen=True)
class SoFar:
    """An epoch's part trained before a resume: where it stopped in the epoch's order, and the
    loss sum, samples and seconds it had made."""
    position: int = 0
    loss_sum: float = 0.0
    samples: int = 0
    seconds: float = 0.0


def train_epoch(rt: Runtime, parts: StepParts, loader, description: str = "train", *,
                so_far: SoFar = SoFar(), after_step: Callable[[EpochCursor], None] | None = None,
                nonfinite: FirstNonFinite | None = None) -> dict:
    """Train one epoch of `parts.model` (or its rest, from `so_far`: the position in its order
    and the figures made before the resume). `after_step(cursor)` runs after every optimizer
    step; it may raise to leave the epoch (the loop holds no other state). `nonfinite` records
    the first batch (counted from 0 in this call) whose loss is NaN/inf."""
    model, start = parts.model, so_far.position
    model.train()
    progress = EpochProgress(len(loader), description)
    cursor = EpochCursor(start, 0, torch.zeros((), dtype=torch.float64, device=rt.device), 0,
                         time.perf_counter(), begin=start)
    try:
        for batch in _timed(loader, cursor):
            loss = train_step(rt, model, parts.optimizer, parts.loss_fn, batch, parts.settings)
            if nonfinite is not None:
                nonfinite.observe(loss, cursor.steps)  # on the device: no sync
            info = rt.step_info
            n = info.local_count
            cursor.loss_sum += loss.to(torch.float64) * n
            cursor.local_samples += n
            cursor.position += info.global_count
            cursor.steps += 1
            progress.update(info.global_count, loss)
            if after_step is not None and info.sync:
                after_step(cursor)
    finally:
        progress.close()
    loss_sum, samples, waited = cursor.totals(rt.env)  # a sync point: the time includes all GPU work
    this_call = time.perf_counter() - cursor.start
    loss_sum, samples, seconds = (loss_sum + so_far.loss_sum, samples + so_far.samples,
                                  this_call + so_far.seconds)
    return {
        "train_loss": loss_sum / max(samples, 1),
        "train_samples": samples,
        "epoch_seconds": seconds,
        "samples_per_second": samples / max(seconds, 1e-9),
        # the ranks' mean share of this call's time spent waiting for the next batch
        "input_wait": round(min(waited / rt.world_size / max(this_call, 1e-9), 1.0), 4),
    }


@torch.no_grad()
def evaluate(rt: Runtime, model: nn.Module, loss_fn: LossFn, loader, classification: bool,
             settings: StepSettings, target_std: torch.Tensor | None = None) -> dict:
    """Loss (and accuracy) over the whole validation set, each sample counted exactly once.

    Regression with `target_std` (the data's std per output, DataBundle.target_scale) also gives
    val_mae and val_rmse in the data's original units: over every predicted value of every sample,
    the error times its output's std (the mean cancels out of a difference)."""
    model.eval()
    sums = Sums(rt.env)
    scale = None if classification or target_std is None else target_std.to(rt.device, torch.float64)
    if scale is not None:  # every rank reduces the same names, even one that gets no batch
        sums.add(abs_error=0.0, squared_error=0.0, values=0)
    for x, y in loader:
        x = prepare_inputs(x, settings)
        compiling.begin_step(model)
        with rt.autocast():
            out = model(x).float()
        n = y.shape[0]
        sums.add(loss_sum=loss_fn(out, y) * n, samples=n)
        if classification:
            sums.add(correct=correct_count(out, y))
        elif scale is not None:
            error = (out.double() - y.double()) * scale
            sums.add(abs_error=error.abs().sum(), squared_error=error.square().sum(), values=error.numel())
    totals = sums.reduce()
    result = {"val_loss": totals["loss_sum"] / max(totals["samples"], 1),
              "val_samples": int(totals["samples"])}
    if classification:
        result["val_accuracy"] = totals["correct"] / max(totals["samples"], 1)
    elif scale is not None:
        values = max(totals["values"], 1.0)
        result["val_mae"] = totals["abs_error"] / values
        result["val_rmse"] = math.sqrt(totals["squared_error"] / values)
    return result
