"""Prepared DataLoaders: this rank's exact share of each step (multigpu.core.loading.data plans it), on the device.

`shard_loader` rebuilds a user's DataLoader around a ShardedBatchSampler, keeping its settings;
`PreparedLoader` iterates it, tells the runtime each step's real sample counts, copies batches to
the GPU ahead of the step, and can go on from a position inside an epoch; with workers, one
DataLoader iterator serves epoch after epoch (EpochAfterEpoch), so the workers never wait at an
epoch's end. A dataset with an
`on_device(batch, device) -> batch` method finishes its batches there, in a thread on a stream of
its own, also ahead of the step (prefetch_thread; folder: data decodes its JPEGs that way), as
many batches at once as its `on_device_threads(device)` says (1 without it).
"""
from __future__ import annotations

import copy
import random
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler,
                              Sampler, SequentialSampler, Subset, SubsetRandomSampler)

from multigpu.core.loading.data import ShardedBatchSampler, StepInfo, map_tensors, move_to_device
from multigpu.core.errors import UsageError
from multigpu.core.loading.loader_workers import own_group_context
from multigpu.core.loading.prefetch_thread import finish_in_thread


class PreparedLoader:
    """A DataLoader whose batches are this rank's exact share, already on the device.

    Iterating it starts a new epoch: the order is reshuffled (no `set_epoch` to forget), and
    before each batch is yielded `on_step(info)` tells the runtime how many real samples it holds.
    `state_dict()` says where the next batch would come from (epoch and position in its order);
    `load_state_dict()` of that, in a resumed run of any world size, goes on from there.

    With workers, a loader that shuffles (a training loader), or one given `set_last_epoch`, keeps
    its DataLoader iterator from one epoch to the next: the workers are asked for the next epoch's
    first batches while the current one's last are handed out, so they are ready when it begins,
    also after an evaluation in between (on one H200, 9-11 % of each real-JPEG epoch was spent
    waiting for its first batches when each epoch began from nothing). The batches, their order
    and their augmentation are the same as with a fresh iterator per epoch. A resume inside an
    epoch, an epoch that is not the next one, or one after an epoch left before its end starts a
    fresh iterator (the old one's workers end first). Without `set_last_epoch`, the last epoch's
    end has the workers decode up to workers x prefetch_factor batches of an epoch that may never
    run, and they live on, like persistent workers, until the loader is dropped. A loader that does
    not shuffle (evaluation) starts each pass afresh, as a DataLoader does.
    """

    def __init__(self, loader: DataLoader, sampler: ShardedBatchSampler, device: torch.device,
                 on_step: Callable[[StepInfo | None], None], accumulate: int = 1, dataset=None):
        self.loader, self.sampler, self.device = loader, sampler, device
        self.on_step, self.accumulate = on_step, accumulate
        self._dataset = loader.dataset if dataset is None else dataset
        self.epoch = 0          # the epoch the next iteration runs (0-based)
        self.position = 0       # samples of the epoch being iterated that were handed out
        self._resume_at = None  # (epoch, position) for the next iteration, from set_epoch
        self._schedule = loader.batch_sampler if isinstance(loader.batch_sampler, EpochAfterEpoch) else None
        self._continuous = self._schedule is not None and sampler.shuffle
        self.last_epoch = None  # the last epoch that will run, if known (set_last_epoch)
        self._live = None       # the DataLoader iterator kept from one epoch to the next
        self._next = None       # (epoch, start) of _live's next batch, once an epoch was taken whole
        self._turn = 0          # which iteration may take batches from _live
        self._owed_draw = False  # _live was started ahead (start_workers): its seed draw is owed
        self.watch = None       # stragglers.Stragglers of a training loader: its waits, its epochs

    def __len__(self) -> int:
        """Steps of the next (or current) iteration."""
        return len(self.sampler) if self._resume_at else len(self.sampler.full_plan)

    @property
    def dataset(self):
        return self._dataset

    @property
    def num_samples(self) -> int:
        return self.sampler.num_samples

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Only needed to resume: the next iteration runs epoch `epoch` (0-based) from position
        `start` of its order. Iteration otherwise advances the epoch by itself."""
        self.epoch = epoch
        self._resume_at = (epoch, start)
        self.sampler.set_epoch(epoch, start)

    def set_last_epoch(self, epoch: int | None) -> None:
        """The last epoch (0-based) that will run, or None if not known. A loader with workers
        then keeps them going from each epoch into the next up to that one (also one that does
        not shuffle), and no batch after that epoch's is decoded. Changed between epochs, the
        next one starts a fresh iterator."""
        self.last_epoch = epoch
        self._continuous = self._schedule is not None

    def start_workers(self, last_epoch: int | None) -> bool:
        """Start the workers for a run that begins at the start of epoch 0 and ends with
        `last_epoch` (set_last_epoch), now instead of at the first iteration: they start and make
        its first batches while the run builds its model. Nothing for a loader without workers or
        one that was iterated or told to resume. Whether it started them.

        Torch's iterator draws its workers' base seed from the loader's generator as it starts;
        that draw is undone here and made at the first iteration instead, so that the main
        process's random stream (the model's initial weights among its draws) is the same as
        without the head start. An iteration that begins elsewhere ends these workers and starts
        its own, as _take does."""
        if self._schedule is None or self._live is not None or self._resume_at or self.epoch:
            return False
        self.set_last_epoch(last_epoch)
        generator = self.loader.generator or torch.default_generator
        state = generator.get_state()
        self._schedule.begin(0, 0, last_epoch)
        self._live = iter(self.loader)
        generator.set_state(state)
        self._next, self._owed_draw = (0, 0), True
        return True

    def state_dict(self) -> dict:
        """Where to go on from: inside the epoch being iterated, after its last batch handed out."""
        if 0 < self.position < self.num_samples:
            return {"epoch": self.epoch - 1, "position": self.position}
        return {"epoch": self.epoch, "position": 0}

    def load_state_dict(self, state: dict) -> None:
        self.set_epoch(int(state["epoch"]), int(state.get("position", 0)))

    def __iter__(self):
        epoch, start = self._resume_at or (self.epoch, 0)
        self._resume_at = None
        self.sampler.set_epoch(epoch, start)
        infos = self.sampler.step_infos(self.accumulate)
        self.epoch, self.position = epoch + 1, start
        source = self.loader if self._schedule is None else self._take(epoch, start, len(infos))
        batches = zip(infos, source, strict=True)
        finish = getattr(self._dataset, "on_device", None)
        if self.device.type == "cuda" and finish is not None:
            threads = getattr(self._dataset, "on_device_threads", lambda device: 1)(self.device)
            batches = finish_in_thread(batches, self.device,
                                       lambda b: finish(move_to_device(b, self.device, True), self.device),
                                       threads=threads)
        elif self.device.type == "cuda":
            batches = _prefetch_to_gpu(batches, self.device)
        else:
            batches = ((info, _finished(move_to_device(b, self.device, False), self.device, finish))
                       for info, b in batches)
        watch, began = self.watch, time.perf_counter()
        for info, batch in batches:
            if watch is not None:
                watch.waited(time.perf_counter() - began)
            self.position += info.global_count
            self.on_step(info)
            yield batch
            began = time.perf_counter()
        self.on_step(None)
        if watch is not None:
            watch.epoch_end(epoch)

    def _take(self, epoch: int, start: int, steps: int):
        """The `steps` batches of epoch `epoch` from position `start`: from the iterator that
        served the epoch before, when it was taken whole and this one follows it; else from a new one."""
        if (self._continuous and self._live is not None and self._next == (epoch, start)
                and self._schedule.last == self.last_epoch):  # planned to the same end
            if self._owed_draw or not self.loader.persistent_workers:
                _draw_base_seed(self.loader)
        else:
            self._live = None  # dropped, torch's iterator ends its workers, before new ones start
            last = self.last_epoch if self._continuous else epoch
            self._schedule.begin(epoch, start, last)
            self._live = iter(self.loader)
        self._next, self._turn, self._owed_draw = None, self._turn + 1, False
        turn = self._turn
        for _ in range(steps):
            if turn != self._turn:
                raise RuntimeError("the prepared loader was iterated again before this epoch ended")
            # next() on the attribute, not a local: a left iteration must not keep its workers alive
            yield next(self._live)
        self._next = (epoch + 1, 0)
        if not self._continuous or (self.last_epoch is not None and epoch >= self.last_epoch):
            self._live = self._next = None  # nothing comes after: the workers end now


class EpochAfterEpoch(Sampler[list]):
    """A prepared DataLoader's batch sampler (with workers): epoch `first`'s steps from position
    `start`, then each next epoch's whole plan, up to epoch `last` (None: no end).

    Each epoch's batches are those `sampler` yields for that epoch, from a copy of its own, so the
    PreparedLoader's sampler (its len, step_infos, resume position) keeps the epoch being handed
    out. The DataLoader asks for workers x prefetch_factor batches beyond the one it hands out:
    near an epoch's end, the next epoch's first ones.
    """

    def __init__(self, sampler: ShardedBatchSampler):
        self.sampler = copy.copy(sampler)
        self.first, self.start, self.last = 0, 0, None

    def begin(self, epoch: int, start: int, last: int | None) -> None:
        """Where the next iteration begins, and the epoch it ends with (at least `epoch`)."""
        self.first, self.start, self.last = epoch, start, last

    def __iter__(self):
        epoch, start = self.first, self.start
        while epoch == self.first or self.last is None or epoch <= self.last:
            with warnings.catch_warnings():  # a resume's warning: said by the PreparedLoader's sampler
                warnings.simplefilter("ignore")
                self.sampler.set_epoch(epoch, start)
            yield from self.sampler
            epoch, start = epoch + 1, 0


def _draw_base_seed(loader: DataLoader) -> None:
    """Draw what a new iterator of `loader` draws for its workers' seeds: from the loader's
    generator, torch's global one by default. An epoch that goes on with the kept iterator then
    leaves the main process's random stream (dropout, a script's own draws) where one iterator per
    epoch left it (without persistent workers, which draw once)."""
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)


def _finished(batch, device: torch.device, finish):
    return finish(batch, device) if finish is not None else batch


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


def shard_loader(loader: DataLoader, *, layout: tuple[int, int, int], device: torch.device, seed: int,
                 on_step: Callable[[StepInfo | None], None], accumulate: int = 1,
                 drop_last: bool | None = None) -> PreparedLoader | DataLoader:
    """Rebuild `loader` around a ShardedBatchSampler, keeping the user's loader settings.
    `layout`: (ranks, this rank, devices per rank), as global_batch_sampler.shard_global takes it."""
    num_ranks, rank, devices_per_rank = layout
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
    return wrap_sharded(loader, sampler, device, on_step, accumulate)


def wrap_sharded(loader: DataLoader, sampler: ShardedBatchSampler, device: torch.device,
                 on_step: Callable[[StepInfo | None], None], accumulate: int = 1) -> PreparedLoader:
    """`loader` rebuilt around `sampler` (a ShardedBatchSampler of its dataset), its settings kept."""
    dataset, seed = _dataset_and_order(loader)[0], sampler.seed
    workers = loader.num_workers
    served = dataset
    if workers:  # random augmentation in workers: a function of (seed, epoch, sample) alone
        served, sampler.tag_epoch = PerSampleSeed(dataset, seed), True
    rebuilt = DataLoader(
        served, batch_sampler=EpochAfterEpoch(sampler) if workers else sampler, num_workers=workers,
        collate_fn=loader.collate_fn, pin_memory=device.type == "cuda" or loader.pin_memory,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn if workers else None,
        multiprocessing_context=own_group_context(loader.multiprocessing_context) if workers else None,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers if workers else False)
    return PreparedLoader(rebuilt, sampler, device, on_step, accumulate, dataset=loader.dataset)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch (splitmix64 over the three numbers)."""
    x = 0
    for v in (seed, epoch, index):
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x >> 1


class PerSampleSeed(Dataset):
    """Seeds Python's, NumPy's and torch's RNG from (seed, epoch, index) before each sample.

    DataLoader workers otherwise draw augmentation from a stream that depends on which worker got
    which samples before, and so on the number of workers, the world size, and where a resumed run
    started. With this, a sample's augmentation in an epoch is the same in every run with the
    same seed: exact resume inside an epoch, on any number of devices. Used in worker processes
    only (their RNG is their own); in the main process the RNG is checkpointed per rank instead.
    """

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def _seed(self, epoch: int, index: int) -> None:
        s = sample_seed(self.seed, epoch, index)
        random.seed(s)
        np.random.seed(s % 2**32)
        # The CPU generator alone: torch.manual_seed also queues a seeding of CUDA for when it
        # starts, capturing the Python stack to do so, which took 0.1 ms a sample, several % of
        # a worker's time on a small JPEG. A worker that uses CUDA (spawned) has it started.
        torch.default_generator.manual_seed(s)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(s)

    def __getitem__(self, key):
        epoch, index = key
        self._seed(epoch, index)
        self._tell_epoch(epoch)
        return self.dataset[index]

    def _tell_epoch(self, epoch: int) -> None:
        """A dataset that counts per epoch (a `sample_epoch` attribute: imagefolder's unreadable
        files) learns the epoch of the sample it makes: workers run ahead into the next one."""
        inner = self.dataset.dataset if isinstance(self.dataset, Subset) else self.dataset
        if hasattr(inner, "sample_epoch"):
            inner.sample_epoch = epoch

    def __getitems__(self, keys):
        # Only a dataset that says it reads batches without randomness takes the batch at once
        # (datasets.BatchedWindows); torch's Subset has __getitems__ for every dataset, and
        # seeding once per batch would make a sample's augmentation depend on its batch.
        inner = self.dataset.dataset if isinstance(self.dataset, Subset) else self.dataset
        batched = getattr(self.dataset, "__getitems__", None) if getattr(inner, "batched_reads", False) else None
        if batched is None:
            return [self[k] for k in keys]
        self._seed(*keys[0])  # a batched dataset draws once per batch
        self._tell_epoch(keys[0][0])
        return batched([i for _, i in keys])


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
