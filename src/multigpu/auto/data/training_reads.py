"""Which DataLoader the script reads for training now: one --auto split, or one left whole.

What the first training step's checks (first_step.py) and the summed-loss scaling
(summed_loss.py) both need to know: a loss or a shape error means something for the split only
while the script reads a split loader with gradients on (a training pass). A loader left whole
(evaluation, or a training loader --auto could not split) gives every process the one-process
batch, and there is nothing to correct. A pass under torch.no_grad() is evaluation (loaders.py
reads it whole) and changes nothing here.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader

from multigpu.auto.data.loaders import IndexedBatches
from multigpu.core.loading.data import ShardedBatchSampler


def per_process_batch(loader: DataLoader) -> int | None:
    """The batch size each process reads from `loader` when --auto split it, else None."""
    sampler = loader.batch_sampler
    if isinstance(sampler, IndexedBatches):
        sampler = sampler.positions
    return sampler.batch_size if isinstance(sampler, ShardedBatchSampler) else None


class TrainingReads:
    """The last DataLoader the script began to read with gradients on: `split_batch` is each
    process's batch size when --auto split it, None when it is whole (or none was read yet).
    `on_split(batch)` callbacks run each time a split loader's pass has begun: after its
    workers started, so that nothing a callback installs in this process reaches them."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.split_batch: int | None = None
        self.on_split: list[Callable[[int], None]] = []

    def began(self, loader: DataLoader) -> None:
        if not torch.is_grad_enabled():
            return
        self.split_batch = per_process_batch(loader)
        if self.split_batch is not None:
            for callback in list(self.on_split):
                callback(self.split_batch)

    def install(self) -> None:
        """Wrap DataLoader.__iter__ (after loaders.install, so that the split is in place)."""
        iterate = DataLoader.__iter__

        @functools.wraps(iterate)
        def __iter__(loader):  # noqa: N807 - the loader's own method, wrapped
            batches = iterate(loader)
            self.began(loader)
            return batches

        DataLoader.__iter__ = __iter__
