"""Exact data sharding: every sample once per epoch, on every rank the same number of steps.

The plan of an epoch is computed identically on every rank from (dataset size, seed, epoch):
1. the sample order: a permutation seeded by `seed + epoch` (or 0..n-1 without shuffle);
2. global steps of `batch_size * devices` samples each;
3. the last, partial global step: dropped with `drop_last`; otherwise kept if every device gets
   at least two samples (one, for a batch size of 1 or a tiny dataset), else merged into the step
   before it, so no rank ever gets an empty (or BatchNorm-breaking single-sample) batch, no sample
   is padded in twice, and no rank runs one step more than another (which is what hangs DDP, and
   what crashed DataParallel in post 000 at 99 % of a 7-hour run);
4. each global step is split into near-equal contiguous shares, one per rank.

With the same global batch, 1 process and N processes therefore see the same steps and reach the
same weights, except where step 3 folds a remainder for N devices that 1 device would keep.

Each step carries a `StepInfo`, so the loss can be averaged over the real number of samples in the
optimizer step (see `Runtime.backward`) and gradient accumulation knows its last micro-step.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from multigpu.core.errors import Api, Text, UsageError


@dataclass(frozen=True)
class StepInfo:
    """The sample counts of one step, set as `rt.step_info` by a prepared loader before it yields
    the step's batch; `Runtime.backward` weights the loss with them."""

    index: int          # step number within the epoch
    local_count: int    # real samples on this rank in this step
    global_count: int   # real samples in this step over all ranks
    window_count: int   # real samples in the optimizer step this micro-step belongs to
    sync: bool          # last micro-step of its window: all-reduce now, then the optimizer steps


def plan_global_steps(n: int, global_batch: int, min_step: int, drop_last: bool) -> list[tuple[int, int]]:
    """[start, end) positions in the epoch's order, one pair per global step."""
    if n < min_step:
        raise UsageError(f"the dataset has {n} samples, fewer than the {min_step} that one step "
                         "needs so every device gets at least one; use fewer devices or more data")
    full, rest = divmod(n, global_batch)
    steps = [(i * global_batch, (i + 1) * global_batch) for i in range(full)]
    if rest and not drop_last:
        if rest >= min_step or not steps:
            steps.append((full * global_batch, n))
        else:  # too few for every device: fold into the previous step rather than pad or starve
            steps[-1] = (steps[-1][0], n)
    if not steps:
        raise UsageError(Text(f"drop_last leaves no step: the dataset has {n} samples and one "
                              f"step takes {global_batch}; lower {{}} or keep the last batch",
                              Api("DataLoader.batch_size", text="the DataLoader's batch_size")))
    return steps


def chunk_sizes(n: int, parts: int) -> list[int]:
    """How torch.chunk (and so DataParallel's scatter) splits n samples over `parts` GPUs."""
    size = -(-n // parts)
    return [min(size, n - i) for i in range(0, n, size)]


def _fit_dataparallel_chunks(steps, ranks: int, devices: int, min_chunk: int):
    """DataParallel splits with torch.chunk, not evenly: 10 samples on 4 GPUs are 3, 3, 3, 1.
    Fold a last step whose chunks would leave a GPU idle or with too few samples into the step
    before it (the plan is otherwise unchanged)."""
    def ok(start, end):
        return all(len(c) == devices and min(c) >= min_chunk
                   for c in (chunk_sizes(hi - lo, devices)
                             for lo, hi in (split_share(start, end, ranks, r) for r in range(ranks))))
    if len(steps) > 1 and not ok(*steps[-1]):
        steps = steps[:-2] + [(steps[-2][0], steps[-1][1])]
    return steps


def split_share(start: int, end: int, ranks: int, rank: int) -> tuple[int, int]:
    """This rank's contiguous share of positions [start, end); lower ranks take the extra ones."""
    base, extra = divmod(end - start, ranks)
    lo = start + rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields this rank's indices for each global step of the epoch (the plan: multigpu.core.loading.data).

    `rt.prepare(loader)` builds one for you; use it directly to shard a DataLoader yourself.

    n:                samples in the dataset.
    batch_size:       samples per device in a step.
    num_ranks, rank:  the processes sharing the data, and this one (`env.world_size`, `env.rank`).
    devices_per_rank: GPUs one process drives (DataParallel), else 1.
    shuffle, seed:    a fresh order each epoch from `seed + epoch`, the same on every rank.
    drop_last:        drop the last, partial global step instead of keeping (or folding) it.

    Every rank gets the same number of steps, and each sample appears once per epoch over all
    ranks; no index is repeated to pad. Call `set_epoch(e)` before iterating epoch `e`.

        sampler = ShardedBatchSampler(len(ds), 32, num_ranks=env.world_size, rank=env.rank,
                                      shuffle=True)
        loader = DataLoader(ds, batch_sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader: ...
    """

    def __init__(self, n: int, batch_size: int, *, num_ranks: int = 1, rank: int = 0,
                 devices_per_rank: int = 1, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False):
        if batch_size < 1:
            raise UsageError(f"batch size {batch_size} must be at least 1")
        self.n, self.batch_size = n, batch_size
        self.num_ranks, self.rank, self.devices_per_rank = num_ranks, rank, devices_per_rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        # A rank's batch is batch_size per device; DataParallel splits it over its GPUs.
        self.global_batch = batch_size * devices_per_rank * num_ranks
        devices = devices_per_rank * num_ranks
        # At least 2 samples per device in the last step where the data allows: BatchNorm cannot
        # train on a single sample whose feature map is 1x1 (ResNets on small images).
        self.min_step = devices * min(2, batch_size) if n >= 2 * devices else devices
        self.full_plan = self._plan(0)
        self.steps = self.full_plan  # the plan of the epoch being iterated
        self.start = 0
        self.tag_epoch = False  # yield (epoch, index) pairs, for PerSampleSeed

    def _plan(self, start: int, min_step: int | None = None) -> list[tuple[int, int]]:
        steps = [(start + lo, start + hi) for lo, hi in
                 plan_global_steps(self.n - start, self.global_batch, min_step or self.min_step,
                                   self.drop_last)]
        if self.devices_per_rank > 1:
            steps = _fit_dataparallel_chunks(steps, self.num_ranks, self.devices_per_rank,
                                             min(2, self.batch_size))
        return steps

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate epoch `epoch` from position `start` of its order (0: the whole epoch).

        Resuming inside an epoch: the samples at positions >= start are planned into steps of this
        run's global batch, whatever the world size that trained positions < start, so no sample
        of the epoch is repeated or skipped. With the same global batch the steps are those of an
        uninterrupted epoch (checkpoints are taken between steps)."""
        self.epoch, self.start = epoch, start
        self.steps = self.full_plan if start == 0 else self._resume_plan(start)

    def _resume_plan(self, start: int) -> list[tuple[int, int]]:
        left, devices = self.n - start, self.num_ranks * self.devices_per_rank
        if left <= 0 or (self.drop_last and left < self.global_batch):
            return []
        if left < devices:  # only after a resume onto more devices than samples remain
            warnings.warn(f"{left} sample(s) of epoch {self.epoch} remain after the resume, fewer "
                          f"than the {devices} devices that must each get one; they are skipped",
                          stacklevel=3)
            return []
        return self._plan(start, min(self.min_step, left))  # one per device if two are too many

    def order(self) -> torch.Tensor:
        """The epoch's sample order, identical on every rank (0..n-1 without shuffle)."""
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[list]:
        order = self.order().tolist()
        for start, end in self.steps:
            lo, hi = split_share(start, end, self.num_ranks, self.rank)
            yield [(self.epoch, i) for i in order[lo:hi]] if self.tag_epoch else order[lo:hi]

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def num_samples(self) -> int:
        """Distinct samples one epoch covers, over all ranks."""
        return self.full_plan[-1][1]

    def step_infos(self, accumulate: int = 1) -> list[StepInfo]:
        """One StepInfo per step of the epoch being iterated, grouping `accumulate` steps into
        each optimizer step."""
        infos = []
        for w in range(0, len(self.steps), accumulate):
            window = self.steps[w:w + accumulate]
            window_count = sum(end - start for start, end in window)
            for j, (start, end) in enumerate(window):
                lo, hi = split_share(start, end, self.num_ranks, self.rank)
                infos.append(StepInfo(w + j, hi - lo, end - start, window_count,
                                      j == len(window) - 1))
        return infos


def map_tensors(fn, obj):
    """`obj` with `fn` applied to every tensor in its nested tuples/lists/dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def move_to_device(batch, device: torch.device, non_blocking: bool = True):
    """Tensors in nested tuples/lists/dicts to `device`; everything else unchanged."""
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)
