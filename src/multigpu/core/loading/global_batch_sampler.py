"""The sampler of a global batch (multigpu.core.loading.global_batch): optimizer steps of G positions of
the epoch's order, each made of micro-steps shared out over the ranks as multigpu.core.loading.data does."""
from __future__ import annotations

from torch.utils.data import DataLoader, IterableDataset

from multigpu.core.loading.data import (ShardedBatchSampler, StepInfo, _fit_dataparallel_chunks,
                                plan_global_steps, split_share)
from multigpu.core.errors import Api, Text, UsageError
from multigpu.core.loading.global_batch import BatchPlan


class GlobalBatchSampler(ShardedBatchSampler):
    """A ShardedBatchSampler whose optimizer steps are windows of `window` positions (G), each
    `batch_size x devices`-sample micro-steps; the epoch's remainder joins its last window."""

    def __init__(self, window: int, n: int, batch_size: int, **options):
        self.window = window
        super().__init__(n, batch_size, **options)

    def _plan(self, start: int, min_step: int | None = None) -> list[tuple[int, int]]:
        micro, left = self.global_batch, self.n - start
        full = left // self.window
        if self.drop_last and full == 0:
            raise UsageError(Text(f"drop_last leaves no step: the dataset has {left} samples and "
                                  f"one step takes {self.window}; lower {{}} or keep the last batch",
                                  Api("setup.global_batch_size", self.window)))
        tail = start + (full if self.drop_last else max(full - 1, 0)) * self.window
        steps = [(lo, lo + micro) for lo in range(start, tail, micro)]
        if self.drop_last:
            return steps
        last = [(tail + lo, tail + hi) for lo, hi in
                plan_global_steps(self.n - tail, micro, min_step or self.min_step, False)]
        if self.devices_per_rank > 1:
            last = _fit_dataparallel_chunks(last, self.num_ranks, self.devices_per_rank,
                                            min(2, self.batch_size))
        return steps + last

    def _resume_plan(self, start: int) -> list[tuple[int, int]]:
        if self.drop_last and self.n - start < self.window:
            return []
        return super()._resume_plan(start)

    def step_infos(self, accumulate: int = 1) -> list[StepInfo]:
        """One StepInfo per micro-step; an optimizer step per window of G positions from where the
        epoch (or its resumed rest) begins, the last window holding the remainder too."""
        if not self.steps:
            return []
        last_window = max(0, (self.steps[-1][1] - self.start) // self.window - 1)
        groups: dict[int, list[tuple[int, int]]] = {}
        for lo, hi in self.steps:
            groups.setdefault(min((lo - self.start) // self.window, last_window), []).append((lo, hi))
        infos = []
        for window in groups.values():
            count = sum(hi - lo for lo, hi in window)
            for j, (start, end) in enumerate(window):
                lo, hi = split_share(start, end, self.num_ranks, self.rank)
                infos.append(StepInfo(len(infos), hi - lo, end - start, count, j == len(window) - 1))
        return infos


def shard_global(loader: DataLoader, plan: BatchPlan, *, layout: tuple[int, int, int], device,
                 seed: int, on_step, drop_last: bool | None = None):
    """`loader` rebuilt to make `plan`'s global batch; `layout`: (ranks, rank, devices per rank)."""
    from multigpu.core.loading.loaders import _dataset_and_order, wrap_sharded

    if isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
        raise UsageError(Text("{} shares out each step's samples by index: give it a DataLoader "
                              "of a map-style dataset built with batch_size=B (the largest per "
                              "device)", Api("setup.global_batch_size", plan.global_batch)))
    ranks, rank, per_rank = layout
    dataset, shuffle = _dataset_and_order(loader)
    sampler = GlobalBatchSampler(plan.global_batch, len(dataset), plan.micro, num_ranks=ranks,
                                 rank=rank, devices_per_rank=per_rank, shuffle=shuffle, seed=seed,
                                 drop_last=loader.drop_last if drop_last is None else drop_last)
    return wrap_sharded(loader, sampler, device, on_step, plan.accumulate)
