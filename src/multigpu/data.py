"""Exact data sharding: every sample once per epoch, on every rank the same number of steps.

The plan of an epoch is computed identically on every rank from (dataset size, seed, epoch):
1. the sample order: a permutation seeded by `seed + epoch` (or 0..n-1 without shuffle);
2. global steps of `batch_size * devices` samples each;
3. the last, partial global step: dropped with `drop_last`; otherwise kept if every device gets
   at least two samples (one, for a batch size of 1 or a tiny dataset), else merged into the step
   before it, so no rank ever gets an empty (or BatchNorm-breaking single-sample) batch, no sample is padded in twice, and no rank runs one step more than another (which is
   what hangs DDP, and what crashed DataParallel in post 000 at 99 % of a 7-hour run);
4. each global step is split into near-equal contiguous shares, one per rank.

With the same global batch, 1 process and N processes therefore see the same steps and reach the
same weights, except where step 3 folds a remainder for N devices that 1 device would keep.

Each step carries a `StepInfo`, so the loss can be averaged over the real number of samples in the
optimizer step (see `Runtime.backward`) and gradient accumulation knows its last micro-step.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset, RandomSampler,
                              Sampler, SequentialSampler, Subset, SubsetRandomSampler)

from multigpu.errors import UsageError


@dataclass(frozen=True)
class StepInfo:
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
        raise UsageError(f"drop_last leaves no step: the dataset has {n} samples and one step "
                         f"takes {global_batch}; lower --batch-size or keep the last batch")
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
    """Yields this rank's indices for each global step of the epoch (see module docstring)."""

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
        min_step = devices * min(2, batch_size) if n >= 2 * devices else devices
        self.steps = plan_global_steps(n, self.global_batch, min_step, drop_last)
        if devices_per_rank > 1:
            self.steps = _fit_dataparallel_chunks(self.steps, num_ranks, devices_per_rank,
                                                  min(2, batch_size))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order().tolist()
        for start, end in self.steps:
            lo, hi = split_share(start, end, self.num_ranks, self.rank)
            yield order[lo:hi]

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def num_samples(self) -> int:
        """Distinct samples one epoch covers, over all ranks."""
        return self.steps[-1][1]

    def step_infos(self, accumulate: int = 1) -> list[StepInfo]:
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


class PreparedLoader:
    """A DataLoader whose batches are this rank's exact share, already on the device.

    Iterating it starts a new epoch: the order is reshuffled (no `set_epoch` to forget), and
    before each batch is yielded `on_step(info)` tells the runtime how many real samples it holds.
    """

    def __init__(self, loader: DataLoader, sampler: ShardedBatchSampler, device: torch.device,
                 on_step: Callable[[StepInfo | None], None], accumulate: int = 1):
        self.loader, self.sampler, self.device = loader, sampler, device
        self.on_step, self.accumulate = on_step, accumulate
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def num_samples(self) -> int:
        return self.sampler.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Only needed to resume: iteration otherwise advances the epoch by itself."""
        self.epoch = epoch

    def __iter__(self):
        self.sampler.set_epoch(self.epoch)
        infos = self.sampler.step_infos(self.accumulate)
        self.epoch += 1
        batches = zip(infos, self.loader, strict=True)
        if self.device.type == "cuda":
            batches = _prefetch_to_gpu(batches, self.device)
        else:
            batches = ((info, move_to_device(b, self.device, False)) for info, b in batches)
        for info, batch in batches:
            self.on_step(info)
            yield batch
        self.on_step(None)


def _prefetch_to_gpu(batches, device: torch.device):
    """Copy batch k+1 to the GPU on a side stream while the model computes on batch k.

    The copies come from pinned memory, so they overlap compute instead of queuing on the compute
    stream. `record_stream` keeps the caching allocator from reusing a batch's memory while the
    compute stream may still read it.
    """
    stream = torch.cuda.Stream(device)

    def issue(item):
        info, batch = item
        with torch.cuda.stream(stream):
            return info, move_to_device(batch, device, non_blocking=True)

    pending = None
    for item in batches:
        # Hand batch k over before issuing k+1's copy: the compute stream then waits for k's copy
        # only, and k+1's copy runs while the caller's step k computes.
        if pending is not None:
            yield _handoff(pending, stream)
        pending = issue(item)
    if pending is not None:
        yield _handoff(pending, stream)


def _handoff(item, stream):
    current = torch.cuda.current_stream(stream.device)
    current.wait_stream(stream)
    map_tensors(lambda t: t.record_stream(current), item[1])
    return item


def shard_loader(loader: DataLoader, *, num_ranks: int, rank: int, devices_per_rank: int,
                 device: torch.device, seed: int, on_step: Callable[[StepInfo | None], None],
                 accumulate: int = 1, drop_last: bool | None = None) -> PreparedLoader | DataLoader:
    """Rebuild `loader` around a ShardedBatchSampler, keeping the user's loader settings."""
    if isinstance(loader.dataset, IterableDataset):
        warnings.warn("an IterableDataset cannot be sharded exactly by multigpu: each rank gets "
                      "the whole stream unless the dataset splits itself by rank", stacklevel=3)
        return loader
    if loader.batch_size is None:
        raise UsageError("this DataLoader was built with its own batch_sampler, which multigpu "
                         "cannot shard; build it with batch_size=B (per device) instead")
    dataset, shuffle = _dataset_and_order(loader)
    sampler = ShardedBatchSampler(
        len(dataset), loader.batch_size, num_ranks=num_ranks, rank=rank,
        devices_per_rank=devices_per_rank, shuffle=shuffle, seed=seed,
        drop_last=loader.drop_last if drop_last is None else drop_last)
    workers = loader.num_workers
    rebuilt = DataLoader(
        dataset, batch_sampler=sampler, num_workers=workers,
        collate_fn=loader.collate_fn, pin_memory=device.type == "cuda" or loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers if workers else False)
    return PreparedLoader(rebuilt, sampler, device, on_step, accumulate)


def _dataset_and_order(loader: DataLoader):
    """The dataset to shard and whether to shuffle it, from the user's sampler.

    Only samplers whose meaning survives sharding are accepted: an unknown sampler (weighted,
    grouped by length, ...) would otherwise be dropped silently and train on the wrong samples.
    """
    sampler, dataset = loader.sampler, loader.dataset
    if isinstance(sampler, SubsetRandomSampler):  # a train/val split done with a sampler
        return Subset(dataset, [int(i) for i in sampler.indices]), True
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler.num_samples != len(dataset):
            raise UsageError("a RandomSampler with replacement or num_samples cannot be sharded "
                             "exactly; use shuffle=True, or shard the data yourself")
        return dataset, True
    if isinstance(sampler, SequentialSampler):
        return dataset, False
    if isinstance(sampler, DistributedSampler):  # code written for hand-made DDP: replaced
        return dataset, sampler.shuffle
    raise UsageError(f"the DataLoader uses a {type(sampler).__name__}, which multigpu cannot shard "
                     "exactly; use shuffle=True/False, a SubsetRandomSampler, or pass the loader "
                     "unprepared and shard it yourself")
