"""DataLoaders that shuffle are split over the processes; the others stay whole.

A loader built with `shuffle=True` (or a RandomSampler, or a SubsetRandomSampler) is the training
data: it gets multigpu's exact sharded sampler (multigpu.core.loading.data): every sample once per epoch
over all processes, the same number of steps on each, a new order each epoch (the epoch is
counted by the loader's iterations, so `set_epoch` needs no call from the script). By default the
script's batch_size keeps its meaning as the global batch, each of N processes taking
batch_size / N, so the script's learning rate stays right; `--auto-batch per-gpu` keeps it per
process.

A loader without shuffle (evaluation, in most scripts) is left whole on every process: each
process computes the script's metrics over the whole set, so the numbers it prints are the
one-process numbers, without a reduction the script does not have. The price is evaluation
repeated on every process. A shuffled loader read under torch.no_grad() (or inference_mode) is
evaluation too, and is read whole there: pytorch/examples' MNIST shuffles its test loader on
GPUs and divides its count of correct answers by len(test_loader.dataset); split, each process
would print half the accuracy. Such a pass is no epoch of the split order.

The workers of every loader the script builds, split or whole, run in process groups of their own
(multigpu.core.loading.loader_workers), as the library's do: the stop that torchrun and a sweep send to a
rank's group leaves them to the script, whose own SIGTERM handler can then finish its step (or its
evaluation) and save.

A loader over an IterableDataset (a stream) is split when a pass over it trains, with or without
a __len__: streams.py says how. Refused in one line, when the loader is built: a batch_sampler of
the script's own, and random samplers that draw with replacement (an exact split has no meaning
for them).
"""
from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch
from torch.utils.data import (DataLoader, IterableDataset, RandomSampler, Sampler,
                              SubsetRandomSampler, WeightedRandomSampler)

from multigpu.auto.data import streams
from multigpu.core.loading.data import ShardedBatchSampler
from multigpu.core.errors import UsageError
from multigpu.core.loading.loader_workers import own_group_context

# DataLoader arguments that a batch_sampler replaces (DataLoader refuses them beside one)
_REPLACED = ("batch_size", "shuffle", "sampler", "drop_last")


class IndexedBatches(Sampler[list[int]]):
    """A ShardedBatchSampler over positions 0..n-1 of `indices` (a SubsetRandomSampler's subset),
    yielding the dataset indices at those positions."""

    def __init__(self, positions: ShardedBatchSampler, indices: list[int]):
        self.positions, self.indices = positions, indices

    def set_epoch(self, epoch: int) -> None:
        self.positions.set_epoch(epoch)

    def __iter__(self):
        for batch in self.positions:
            yield [self.indices[i] for i in batch]

    def __len__(self) -> int:
        return len(self.positions)


def random_subset(given: dict) -> list[int] | range | None:
    """The indices a training loader draws in random order (range: the whole dataset), or None
    for a loader that does not shuffle. Raises a UsageError for random samplers with replacement."""
    sampler, dataset = given.get("sampler"), given["dataset"]
    if sampler is None:
        return range(len(dataset)) if given.get("shuffle") else None
    if isinstance(sampler, WeightedRandomSampler) or (
            isinstance(sampler, RandomSampler)
            and (sampler.replacement or sampler._num_samples is not None)):
        raise UsageError(f"the script's DataLoader draws samples at random with replacement "
                         f"({type(sampler).__name__}); --auto splits an epoch exactly and cannot "
                         "split that: use shuffle=True, or run without --auto and shard it yourself")
    if isinstance(sampler, SubsetRandomSampler):
        return [int(i) for i in sampler.indices]
    if isinstance(sampler, RandomSampler):
        return range(len(sampler.data_source))
    return None  # a sampler of another kind: left as the script made it


def per_process_batch(batch_size: int | None, world_size: int, mode: str) -> int:
    """Each process's batch size for a loader the script gave `batch_size`."""
    if batch_size is None:
        raise UsageError("the script's shuffling DataLoader has batch_size=None (no batching); "
                         "--auto splits batches: give it a batch_size")
    if mode == "per-gpu":
        return batch_size
    if batch_size % world_size:
        raise UsageError(f"DataLoader(batch_size={batch_size}) cannot be split evenly over "
                         f"{world_size} processes: --auto takes batch_size as the global batch, "
                         f"batch_size / {world_size} per process; give a multiple of "
                         f"{world_size}, or run with --auto-batch per-gpu to keep "
                         f"{batch_size} per process")
    return batch_size // world_size


def loader_seed(generator: torch.Generator | None, count: int) -> int:
    """The order's seed for the `count`-th split loader: from the seed the script gave torch (or
    the loader's generator), so a seeded script shuffles alike from run to run. Read, not drawn:
    drawing would shift the script's random numbers (its model's initial weights) from those of
    its one-process run."""
    base = generator.initial_seed() if generator is not None else torch.initial_seed()
    return (base + count * 1_000_003) % 2**63


def sharded_arguments(given: dict, *, rank: int, world_size: int, mode: str,
                      agree: Callable[[int], int], count: int = 0,
                      env=None) -> tuple[dict, Sampler | streams.StreamSplit] | None:
    """The DataLoader arguments that split the loader the script asked for (`given`, by name)
    over the processes, and the batch sampler in them (a stream's StreamSplit); None to leave it
    as it is. `agree(seed)`: rank 0's seed on every rank (a collective); `count`: split loaders
    before; `env`: the process group a stream's split compares its streams over (streams.py)."""
    if isinstance(given["dataset"], IterableDataset):
        if env is None or world_size == 1:  # one process: nothing to split
            return None
        split = streams.split(given, env, lambda size: per_process_batch(size, world_size, mode))
        return None if split is None else (own_groups(split[0]), split[1])
    if given.get("batch_sampler") is not None:
        raise UsageError(f"the script gives its DataLoader a batch_sampler "
                         f"({type(given['batch_sampler']).__name__}): --auto splits data by "
                         "choosing the batches itself; pass batch_size= and shuffle=True "
                         "instead, or run without --auto and shard it yourself")
    subset = random_subset(given)
    if subset is None:
        return None
    batch = per_process_batch(given.get("batch_size", 1), world_size, mode)
    seed = agree(loader_seed(given.get("generator"), count))
    positions = ShardedBatchSampler(len(subset), batch, num_ranks=world_size, rank=rank,
                                    shuffle=True, seed=seed,
                                    drop_last=bool(given.get("drop_last", False)))
    sampler = positions if isinstance(subset, range) else IndexedBatches(positions, list(subset))
    kwargs = {k: v for k, v in own_groups(given).items() if k not in _REPLACED} | {"batch_sampler": sampler}
    return kwargs, sampler


def own_groups(given: dict) -> dict:
    """`given` (DataLoader arguments by name) with workers out of the rank's process group, the
    one torchrun's and a sweep's stop reaches."""
    if not given.get("num_workers"):
        return given
    return given | {"multiprocessing_context": own_group_context(given.get("multiprocessing_context"))}


def install(env, mode: str) -> list[None]:
    """Patch DataLoader so that each loader the script builds is split (or not) as above.
    Returns the list that gets an entry for each split loader."""
    init, iterate = DataLoader.__init__, DataLoader.__iter__
    signature = inspect.signature(init)
    agree = functools.partial(_agree, env)
    said = set()
    made: list[None] = []  # one entry per split loader

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments
        given.pop("self")
        split = sharded_arguments(given, rank=env.rank, world_size=env.world_size, mode=mode,
                                  agree=agree, count=len(made), env=env)
        if split is None:
            return init(self, **own_groups(given))
        made.append(None)
        init(self, **split[0])
        self.__dict__["_multigpu_auto_sampler"] = split[1]
        self.__dict__["_multigpu_auto_epoch"] = -1
        self.__dict__["_multigpu_auto_given"] = given
        if mode == "per-gpu" and env.rank == 0 and "lr" not in said:
            said.add("lr")
            print(per_gpu_note(given.get("batch_size", 1), env.world_size), file=sys.stderr)

    @functools.wraps(iterate)
    def __iter__(self):
        sampler = self.__dict__.get("_multigpu_auto_sampler")
        if sampler is None:
            return iterate(self)
        if not torch.is_grad_enabled():  # evaluation: the whole set, and no epoch passes
            if "_multigpu_auto_whole" not in self.__dict__:
                self.__dict__["_multigpu_auto_whole"] = whole_loader(
                    init, self.__dict__["_multigpu_auto_given"])
            return iterate(self.__dict__["_multigpu_auto_whole"])
        self.__dict__["_multigpu_auto_epoch"] += 1  # each new pass over the loader: next epoch
        sampler.set_epoch(self.__dict__["_multigpu_auto_epoch"])
        if isinstance(sampler, streams.StreamSplit):  # a stream's steps pass through its split
            return sampler.batches(iterate(self))
        return iterate(self)

    DataLoader.__init__, DataLoader.__iter__ = __init__, __iter__
    return made


def whole_loader(init, given: dict) -> DataLoader:
    """The loader the script asked for, unsplit: built by DataLoader's own __init__, not the
    patched one, for the passes the script makes under no_grad."""
    loader = DataLoader.__new__(DataLoader)
    init(loader, **own_groups(given))
    return loader


def per_gpu_note(batch_size: int, world_size: int) -> str:
    return (f"multigpu: note: --auto-batch per-gpu: each of the {world_size} processes takes "
            f"batch_size={batch_size}, a global batch of {batch_size * world_size}; the script's "
            f"learning rate is used as given, so an epoch makes {world_size}x fewer optimizer "
            f"steps; if accuracy lags the one-GPU run, scale the learning rate by {world_size} "
            "(linear scaling) or train more epochs, or drop --auto-batch per-gpu")


def _agree(env, seed: int) -> int:
    """Rank 0's seed on every rank: an unseeded script draws a different one on each."""
    return env.broadcast_object(seed)
