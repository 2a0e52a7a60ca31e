"""A DataLoader over an IterableDataset (a stream), when the script trains on it: split over the
processes, every item once per epoch, the same number of steps on every process.

Which passes are split. A stream has no shuffle flag to tell training data from evaluation data,
so the rule is the one loaders.py applies to a shuffled loader read for evaluation: a pass over the
loader with gradients enabled is training, and is split; a pass under torch.no_grad() (or
inference_mode) reads the whole stream on every process, so that an evaluation's metrics are the
one-process numbers. A stream the script evaluates with gradients enabled is split too (each
process then counts its share only).

How it is split. When the loader is built, every process reads the first item of the stream
(`next(iter(dataset))`, in the process itself, with the random states of torch, random and numpy
put back after it) and the processes compare it:

* The same on every process: a stream that knows nothing of ranks. Each process reads the whole
  stream and keeps the items at its positions, item i to process i % N. The stream is cut into
  global steps of the script's batch_size (batch_size / N per process, as a shuffled loader's;
  --auto-batch per-gpu: batch_size per process), and its last, partial step is kept, folded into
  the step before it, or dropped (drop_last) exactly as ShardedBatchSampler plans an epoch's last
  step (multigpu.core.loading.data), so no process has an empty batch nor a step more than another. Every
  process reads the same stream, so every one knows where it ends: no collective at all, neither
  per batch nor at the end. With DataLoader workers this holds for each worker's stream (a dataset
  that shards itself over workers with get_worker_info keeps doing so): each worker plans its own
  steps and the loader interleaves them as it interleaves its workers' batches. The price: each
  process reads (and decodes) the whole stream to keep 1/N of it (the choosing itself costs
  0.2 us an item). The loader's `dataset` is then a view of the script's, whose attributes are
  read and set through it (a worker_init_fn sharding it still does), but not of its class, and
  whose len() is the steps.
* Not the same: a stream that shards itself by rank (it reads RANK and WORLD_SIZE, or
  torch.distributed's rank, as webdataset's split_by_node and MosaicML's streaming do), or one
  whose order each process draws unseeded. It is not split a second time: each process trains on
  its own stream, and rank 0 says so in a note. Such streams end after different numbers of items,
  so before each step the processes agree on whether each has a full batch left (one all-reduce
  of one integer over the CPU group, no GPU sync: 150 to 650 us a step, measured with 2 and 3
  gloo processes on a 2-core host under a load of 4 to 9; streams the same everywhere pay none).
  At the first step where one has not, they pool what is left of their streams, with the last
  full step (held back one step for this), and split that as ShardedBatchSampler splits an
  epoch's last steps. Items move between the processes then, so this kind collates its batches in
  the process rather than in the loader's workers; what is pooled (sent to every process) is all
  that lies past the shortest stream: small when the shards are near equal, a whole shard's items
  where webdataset's split_by_node gives one process a shard more (a shard count that divides by
  the processes avoids that). A WebDataset left with its default nodesplitter (single_node_only)
  refuses more than one process (a ValueError of its own, --auto or not): said in one line, with
  its two fixes (split_by_node, kept as above; None, split by position).

The first item is all that is compared: a stream that is the same at its start but not later
(its own random order after an identical first item) is split by position, and its processes may
then train on some items twice and miss others. Seeding the script (torch.manual_seed, which
also seeds the loader's workers, and random.seed) makes a random stream the same everywhere.

Nothing is refused for having no end: whether a stream ends cannot be told before it does, and an
endless one is split as any other (each process reads it and keeps its positions; the script
ends its loop as it would in one process). A stream with a __len__: `len(loader)` is the steps a
process takes in an epoch (the count of one stream; with workers each worker's last step may add
one, as torch's own count of an IterableDataset's batches is then off). Refused in one line:
batch_size=None (the stream's items are batches already; they cannot be split into a global
batch), and a stream with fewer items than processes (the exact sampler refuses that too).
An IterDataPipe is left to torch's DataLoader, which shards it over the ranks and workers itself
(where it has a sharding_filter), as it did before --auto split streams; its uneven end is not
handled.
"""
from __future__ import annotations

import hashlib
import itertools
import pickle
import random
import sys
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from multigpu.core.loading.data import map_tensors, plan_global_steps, split_share
from multigpu.core.errors import UsageError


def last_step_minimum(n: int, ranks: int, batch: int) -> int:
    """ShardedBatchSampler's smallest last step (its min_step) for an epoch of n items: two items
    a process where the epoch has them (a BatchNorm cannot train on one), else one."""
    return ranks * min(2, batch) if n >= 2 * ranks else ranks


def too_few(n: int, ranks: int, worker: int | None) -> str:
    where = "the stream" if worker is None else f"the stream of DataLoader worker {worker}"
    return (f"{where} has {n} item(s), fewer than the {ranks} processes that each need one in "
            "a step; give it more items, or use fewer workers or processes")


class TooFew:
    """Yielded by a worker in place of a step: a stream too short to split (a UsageError raised in
    a worker would reach the process as a multi-line one)."""

    def __init__(self, n: int, ranks: int, worker: int | None):
        self.message = too_few(n, ranks, worker)


def position_steps(items: Iterable, rank: int, ranks: int, batch: int, drop_last: bool,
                   worker: int | None = None) -> Iterator[list]:
    """This rank's share of each global step of `items` (batch * ranks items), by position: item
    i to rank i % ranks. A full step is yielded once the next one is full too, so that the end
    can fold a short remainder into it, as ShardedBatchSampler does."""
    size = batch * ranks
    held, mine, n = None, [], 0
    for item in items:
        if n % ranks == rank:
            mine.append(item)
        n += 1
        if n % size == 0:
            if held is not None:
                yield held
            held, mine = mine, []
    rest = n % size
    if rest == 0 or drop_last:  # drop_last: the partial step goes, as the exact sampler drops it
        if held is not None:
            yield held
        return
    if held is None:  # the whole stream is one partial step
        if rest < ranks:
            if worker is None:
                raise UsageError(too_few(n, ranks, None))
            yield TooFew(n, ranks, worker)
        else:
            yield mine
    elif rest >= last_step_minimum(n, ranks, batch):
        yield held
        yield mine
    else:  # too few for every process to get its share: folded into the step before
        yield held + mine


def steps_in(n: int, ranks: int, batch: int, drop_last: bool) -> int:
    """The steps position_steps makes of a stream of n items."""
    full, rest = divmod(n, batch * ranks)
    if rest == 0 or drop_last:
        return full
    if full == 0:
        return int(rest >= ranks)
    return full + int(rest >= last_step_minimum(n, ranks, batch))


class PositionShare(IterableDataset):
    """The script's stream as one process's share of its global steps: lists of items, collated
    by the loader (batch_size=None). In a worker, that worker's stream."""

    def __init__(self, dataset, rank: int, ranks: int, batch: int, drop_last: bool):
        self.dataset, self.rank, self.ranks = dataset, rank, ranks
        self.batch, self.drop_last = batch, drop_last

    def __iter__(self):
        info = get_worker_info()
        return position_steps(self.dataset, self.rank, self.ranks, self.batch, self.drop_last,
                              None if info is None else info.id)

    def __len__(self) -> int:  # a TypeError where the script's stream has no length, as before
        return steps_in(len(self.dataset), self.ranks, self.batch, self.drop_last)

    def __getattr__(self, name: str):
        """The script's own attributes, as `loader.dataset.classes` (not while unpickled in a
        worker, when `dataset` is not set yet)."""
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value) -> None:
        """Set on the script's dataset: a worker_init_fn that shards it over the workers sets
        `get_worker_info().dataset.start` (torch's documented way), which is this object."""
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)


_OWN = ("dataset", "rank", "ranks", "batch", "drop_last")  # PositionShare's own attributes


class Collate:
    """The script's collate_fn on one step's list of items; a TooFew passed on as it is."""

    def __init__(self, collate: Callable):
        self.collate = collate

    def __call__(self, step):
        return step if isinstance(step, TooFew) else self.collate(step)


def agreed_steps(items: Iterator, env, batch: int, drop_last: bool) -> Iterator[list]:
    """This rank's steps of its own stream `items`, the ranks' streams being of different
    lengths: a step while every rank has `batch` items left; then all that is left, pooled over
    the ranks with the last full step, planned as the exact sampler plans an epoch's end."""
    ranks, size = env.world_size, batch * env.world_size
    held, done = None, 0  # done: items over all ranks in the steps yielded
    while True:
        mine = list(itertools.islice(items, batch))
        if env.all_max([batch - len(mine)])[0] == 0:  # every rank has a full batch
            if held is not None:
                yield held
                done += size
            held = mine
            continue
        rest = (held or []) + mine + list(items)
        pooled = [x for part in env.all_gather_object(rest) for x in part]
        yield from pooled_steps(pooled, done + len(pooled), env.rank, ranks, batch, drop_last)
        return


def pooled_steps(pooled: list, n: int, rank: int, ranks: int, batch: int,
                 drop_last: bool) -> Iterator[list]:
    """This rank's share of the last steps of an epoch of n items, `pooled` being its last
    items (the same list on every rank)."""
    size = batch * ranks
    if drop_last:
        pooled = pooled[:len(pooled) // size * size]
    if not pooled:
        return
    if len(pooled) < ranks:
        raise UsageError(too_few(n, ranks, None))
    for start, end in plan_global_steps(len(pooled), size, last_step_minimum(n, ranks, batch),
                                        drop_last=False):
        lo, hi = split_share(start, end, ranks, rank)
        yield pooled[lo:hi]


class StreamSplit:
    """What the patched DataLoader keeps of a split stream, where a split loader keeps its
    sampler: the epoch (a stream's order is its own) and what a training pass yields."""

    def __init__(self, env=None, batch: int = 0, drop_last: bool = False,
                 collate: Callable = default_collate, pin: bool = False):
        self.env, self.batch, self.drop_last = env, batch, drop_last  # env: its own streams
        self.collate, self.pin = collate, pin

    def set_epoch(self, epoch: int) -> None:
        pass

    def batches(self, iterator: Iterator) -> Iterator:
        if self.env is None:
            return checked(iterator)
        return self.own_streams(iterator)

    def own_streams(self, iterator: Iterator) -> Iterator:
        items = (item for chunk in iterator for item in chunk)
        for step in agreed_steps(items, self.env, self.batch, self.drop_last):
            out = self.collate(step)
            yield map_tensors(lambda t: t.pin_memory(), out) if self.pin else out


def checked(iterator: Iterator) -> Iterator:
    for step in iterator:
        if isinstance(step, TooFew):
            raise UsageError(step.message)
        yield step


def fingerprint(item) -> str:
    """A digest of an item's content, equal in two processes for equal items."""
    digest = hashlib.sha256()

    def feed(obj):
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and not obj.is_quantized:
            t = obj.detach().cpu().contiguous().reshape(-1)
            digest.update(f"tensor {t.dtype} {tuple(obj.shape)}".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for key, value in obj.items():
                feed(key), feed(value)
        elif isinstance(obj, (list, tuple)):
            digest.update(f"{type(obj).__name__}[{len(obj)}]".encode())
            for value in obj:
                feed(value)
        else:
            try:
                digest.update(pickle.dumps(obj))
            except Exception:  # not picklable: its repr, which may hold an address (then unequal)
                digest.update(repr(obj).encode())
    feed(item)
    return digest.hexdigest()


def first_item(dataset):
    """The stream's first item (None where it has none), read without moving the random states
    the script's own draws come from."""
    states = [random.getstate()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states.append(numpy.random.get_state())
    with torch.random.fork_rng(devices=[]):
        try:
            return next(iter(dataset), None)
        finally:
            random.setstate(states[0])
            if numpy is not None:
                numpy.random.set_state(states[1])


def the_same_everywhere(dataset, env) -> bool:
    """Whether every process's stream starts with the same item (a collective)."""
    try:
        first = first_item(dataset)
    except ValueError as e:
        if "nodesplitter" not in str(e):
            raise
        # webdataset's default nodesplitter (single_node_only) refuses more than one process
        raise UsageError(no_nodesplitter(dataset, env.world_size)) from None
    return len(set(env.all_gather_object(fingerprint(first)))) == 1


def no_nodesplitter(dataset, world_size: int) -> str:
    return (f"the script's {type(dataset).__name__} refuses to run on {world_size} processes "
            "without a nodesplitter (webdataset's single_node_only): give it "
            "nodesplitter=wds.split_by_node (each process then reads its own shards) or "
            "nodesplitter=None (--auto then splits its stream by position)")


def own_streams_note(dataset, world_size: int) -> str:
    return (f"multigpu: note: --auto: the script's IterableDataset ({type(dataset).__name__}) "
            f"starts with another item in each of the {world_size} processes: it shards itself "
            "by rank (as webdataset's split_by_node does), so each process trains on its own "
            "stream, not split again; if it is one stream in an unseeded random order instead, "
            "seed that order alike in every process (torch.manual_seed, random.seed)")


_DROPPED = ("batch_size", "drop_last", "collate_fn")  # what the split sets itself


def split(given: dict, env,
          per_process_batch: Callable[[int], int]) -> tuple[dict, StreamSplit] | None:
    """The DataLoader arguments that split the stream of `given` (the script's, by name) over
    the processes, and the StreamSplit that the training passes go through; None for a
    DataPipe, which torch's DataLoader shards over the ranks itself (its sharding_filter)."""
    dataset = given["dataset"]
    if isinstance(dataset, getattr(torch.utils.data, "IterDataPipe", ())):
        return None
    if given.get("batch_size", 1) is None:
        raise UsageError(f"the script's DataLoader reads an IterableDataset "
                         f"({type(dataset).__name__}) with batch_size=None: its items are "
                         "batches already, which --auto cannot split; give the DataLoader a "
                         "batch_size and let the dataset yield single items, or run without "
                         "--auto and shard it yourself")
    batch = per_process_batch(given.get("batch_size", 1))
    drop_last = bool(given.get("drop_last", False))
    collate = given.get("collate_fn") or default_collate
    kwargs = {k: v for k, v in given.items() if k not in _DROPPED}
    if the_same_everywhere(dataset, env):
        share = PositionShare(dataset, env.rank, env.world_size, batch, drop_last)
        return kwargs | {"dataset": share, "batch_size": None, "collate_fn": Collate(collate)}, \
            StreamSplit()
    if env.rank == 0:
        print(own_streams_note(dataset, env.world_size), file=sys.stderr)
    pin = bool(given.get("pin_memory")) and torch.cuda.is_available()
    return kwargs | {"batch_size": batch, "collate_fn": list, "pin_memory": False}, \
        StreamSplit(env, batch, drop_last, collate, pin)
