"""--auto's split of a stream (an IterableDataset), in this process: the steps each rank takes by
position, planned as the exact sampler plans an epoch; DataLoader workers; streams that shard
themselves by rank, their uneven end agreed over ranks played here by threads."""
from __future__ import annotations

import itertools
import threading

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from multigpu.auto.data import loaders, streams
from multigpu.core.loading.data import ShardedBatchSampler
from multigpu.core.distributed import DistEnv
from multigpu.core.errors import UsageError


def shares(n, ranks, batch, drop_last=False):
    """Each rank's steps of a stream 0..n-1 (lists of items)."""
    return [list(streams.position_steps(range(n), r, ranks, batch, drop_last))
            for r in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 12, 13, 17, 24, 25, 26, 30, 31, 100])
@pytest.mark.parametrize("batch", [1, 2, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_each_rank_takes_its_positions_in_the_exact_sampler_s_steps(ranks, n, batch, drop_last):
    """Every item once over the ranks, the same number of steps on each, and the steps those of
    ShardedBatchSampler over the same n items: the same global steps (the same items in each) and
    the same share sizes, so no rank has an empty batch or a step more than another."""
    if n < ranks and not drop_last:  # the exact sampler refuses it too
        with pytest.raises(UsageError, match=f"^the stream has {n} item"):
            shares(n, ranks, batch)
        return
    got = shares(n, ranks, batch, drop_last)
    try:
        samplers = [ShardedBatchSampler(n, batch, num_ranks=ranks, rank=r, drop_last=drop_last)
                    for r in range(ranks)]
        expected = [list(s) for s in samplers]
    except UsageError:  # drop_last leaves no step: a stream then yields none (torch's loader too)
        expected = [[] for _ in range(ranks)]
    sizes = [[len(b) for b in steps] for steps in got]
    assert sizes == [[len(b) for b in steps] for steps in expected]
    for k in range(len(expected[0])):
        assert sorted(i for steps in got for i in steps[k]) == \
            sorted(i for steps in expected for i in steps[k])
    assert all(i % ranks == r for r, steps in enumerate(got) for step in steps for i in step)
    assert len(streams.PositionShare(range(n), 0, ranks, batch, drop_last)) == len(expected[0])


def test_a_short_remainder_is_folded_into_the_step_before():
    """26 items, 2 ranks, 4 each a step: 3 full steps of 8, then 2, fewer than 2 each: folded."""
    rank0, rank1 = shares(26, 2, 4)
    assert [len(s) for s in rank0] == [4, 4, 5] and [len(s) for s in rank1] == [4, 4, 5]
    assert rank0[-1] == [16, 18, 20, 22, 24]


class Sharded(IterableDataset):
    """n items, each worker of a loader reading every num_workers-th, as torch's docs shard."""

    def __init__(self, n, sized=False):
        self.n, self.sized = n, sized

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


class SizedSharded(Sharded):
    def __len__(self):
        return self.n


class TwoRanks(DistEnv):
    """Rank `rank` of `world_size`, the others' first items being this one's: a stream that
    knows nothing of ranks."""

    def all_gather_object(self, obj):
        return [obj] * self.world_size


def loader_of(rank, ranks, dataset, **kwargs):
    env = TwoRanks(rank=rank, world_size=ranks)
    args, split = loaders.sharded_arguments({"dataset": dataset} | kwargs, rank=rank,
                                            world_size=ranks, mode="global", agree=int, env=env)
    loader = DataLoader(**args)
    return loader, split


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("n", [36, 41])
def test_a_loader_with_workers_splits_each_worker_s_stream(ranks, workers, n):
    """Each worker's stream split by position: over the ranks every item once, the same number
    of steps on each rank; batches of batch_size / ranks but where a worker's last step folds."""
    seen, counts = [], []
    for rank in range(ranks):
        loader, split = loader_of(rank, ranks, Sharded(n), batch_size=6, num_workers=workers)
        steps = [b.tolist() for b in split.batches(iter(loader))]
        counts.append(len(steps))
        seen += [i for b in steps for i in b]
    assert sorted(seen) == list(range(n))
    assert len(set(counts)) == 1


class Range(IterableDataset):
    """torch's docs' second way: a worker_init_fn sets each worker's range on its dataset copy."""

    def __init__(self, start, end):
        self.start, self.end = start, end

    def __iter__(self):
        return iter(range(self.start, self.end))


def range_per_worker(worker_id):
    info = get_worker_info()
    ds = info.dataset
    start, end = ds.start, ds.end
    per = -(-(end - start) // info.num_workers)
    ds.start, ds.end = start + worker_id * per, min(start + (worker_id + 1) * per, end)


def test_a_worker_init_fn_that_shards_the_dataset_copy_of_its_worker_still_does():
    seen = []
    for rank in (0, 1):
        loader, split = loader_of(rank, 2, Range(0, 40), batch_size=4, num_workers=2,
                                  worker_init_fn=range_per_worker)
        seen += [int(i) for b in split.batches(iter(loader)) for i in b]
    assert sorted(seen) == list(range(40))


def test_len_of_a_split_stream_is_its_steps_and_a_stream_without_one_has_none():
    loader, _ = loader_of(0, 2, SizedSharded(37), batch_size=6)
    assert len(loader) == 6 == len(list(loader))  # 37 = 6 steps of 6, the last one folded in
    loader, _ = loader_of(0, 2, SizedSharded(41), batch_size=6)
    assert len(loader) == 7 == len(list(loader))  # 5 left: 2 or 3 each, a step of their own
    loader, _ = loader_of(0, 2, Sharded(41), batch_size=6)
    with pytest.raises(TypeError):
        len(loader)


def test_what_a_stream_cannot_be_split_into_is_refused_in_one_line():
    with pytest.raises(UsageError, match=r"^the script's DataLoader reads an IterableDataset "
                                         r"\(Sharded\) with batch_size=None: its items are "
                                         r"batches already"):
        loader_of(0, 2, Sharded(8), batch_size=None)
    loader, split = loader_of(0, 2, Sharded(1), batch_size=2, num_workers=2)
    with pytest.raises(UsageError) as e:
        list(split.batches(iter(loader)))
    assert str(e.value) == ("the stream of DataLoader worker 0 has 1 item(s), fewer than the 2 "
                            "processes that each need one in a step; give it more items, or use "
                            "fewer workers or processes")


class ThreadRanks(DistEnv):
    """Ranks played by threads, for the collectives agreed_steps makes."""

    def __init__(self, rank, world_size, board):
        super().__init__(rank=rank, world_size=world_size)
        object.__setattr__(self, "board", board)

    def _exchange(self, value):
        board = self.board
        board["values"][self.rank] = value
        board["barrier"].wait()
        out = list(board["values"])
        board["barrier"].wait()
        return out

    def all_max(self, values):
        return [max(v) for v in zip(*self._exchange(values))]

    def all_gather_object(self, obj):
        return self._exchange(obj)


def own_streams(lengths, batch, drop_last=False):
    """Each rank's steps of its own stream (rank r: the items (r, 0..lengths[r]-1))."""
    ranks = len(lengths)
    board = {"values": [None] * ranks, "barrier": threading.Barrier(ranks)}
    out = [None] * ranks

    def run(rank):
        env = ThreadRanks(rank, ranks, board)
        items = iter([(rank, i) for i in range(lengths[rank])])
        try:
            out[rank] = list(streams.agreed_steps(items, env, batch, drop_last))
        except UsageError as e:
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    return out


@pytest.mark.parametrize("lengths", [(12, 12), (13, 12), (12, 20), (3, 30), (9, 10, 11), (0, 7, 8),
                                     (8, 8, 8), (1, 0, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_streams_that_shard_themselves_end_together_every_item_once(lengths, drop_last):
    """Streams of different lengths (a dataset sharding itself by rank): the same number of steps
    on every rank, every item once, the last steps those of the exact sampler for all the items."""
    ranks, batch = len(lengths), 2
    got = own_streams(lengths, batch, drop_last)
    if sum(lengths) < ranks and not drop_last:  # the exact sampler refuses it too
        assert [str(e) for e in got] == [f"the stream has {sum(lengths)} item(s), fewer than the "
                                         f"{ranks} processes that each need one in a step; give "
                                         "it more items, or use fewer workers or processes"] * ranks
        return
    assert len({len(steps) for steps in got}) == 1
    n = sum(lengths)
    try:
        plan = ShardedBatchSampler(n, batch, num_ranks=ranks, drop_last=drop_last)
        expected = [len(plan)] + [(end - start) for start, end in plan.steps]
    except UsageError:
        expected = [0]
    assert [len(got[0])] + [sum(len(steps[k]) for steps in got) for k in range(len(got[0]))] \
        == expected
    items = sorted(x for steps in got for step in steps for x in step)
    if not drop_last:
        assert items == sorted((r, i) for r, length in enumerate(lengths) for i in range(length))
    assert len(items) == len(set(items))
    assert all(step for steps in got for step in steps), "no rank has an empty batch"


def test_streams_that_start_alike_are_split_by_position_others_are_each_process_s_own(capsys):
    class ByRank(IterableDataset):
        def __iter__(self):
            return iter(range(7))

    class Others(TwoRanks):
        def all_gather_object(self, obj):
            return [obj, obj + "x"]

    args, split = loaders.sharded_arguments({"dataset": ByRank(), "batch_size": 4}, rank=0,
                                            world_size=2, mode="global", agree=int,
                                            env=TwoRanks(rank=0, world_size=2))
    assert isinstance(args["dataset"], streams.PositionShare) and split.env is None
    args, split = loaders.sharded_arguments({"dataset": ByRank(), "batch_size": 4}, rank=0,
                                            world_size=2, mode="global", agree=int,
                                            env=Others(rank=0, world_size=2))
    assert type(args["dataset"]) is ByRank and args["batch_size"] == 2 and split.env is not None
    assert capsys.readouterr().err == (
        "multigpu: note: --auto: the script's IterableDataset (ByRank) starts with another item "
        "in each of the 2 processes: it shards itself by rank (as webdataset's split_by_node "
        "does), so each process trains on its own stream, not split again; if it is one stream "
        "in an unseeded random order instead, seed that order alike in every process "
        "(torch.manual_seed, random.seed)\n")


def test_reading_the_first_item_leaves_the_script_s_random_numbers_as_they_were():
    import random

    class Random(IterableDataset):
        def __iter__(self):
            yield torch.rand(1).item(), random.random()

    torch.manual_seed(3), random.seed(3)
    first = streams.first_item(Random())
    assert first == next(iter(Random()))  # the same draws as the script's own first pass


def test_equal_items_have_equal_fingerprints_and_others_not():
    a = {"x": torch.arange(6.0).reshape(2, 3), "label": 3, "name": "a"}
    b = {"x": torch.arange(6.0).reshape(2, 3), "label": 3, "name": "a"}
    assert streams.fingerprint(a) == streams.fingerprint(b)
    assert streams.fingerprint(a) != streams.fingerprint(b | {"label": 4})
    assert streams.fingerprint(torch.zeros(2)) != streams.fingerprint(torch.zeros(2, 1))
    assert streams.fingerprint(torch.zeros(2, dtype=torch.bfloat16)) != \
        streams.fingerprint(torch.zeros(2))


def test_an_endless_stream_is_split_as_any_other():
    """Nothing tells an endless stream from a long one ahead: it is split by position, and the
    script ends its loop as in one process."""
    firsts = [list(itertools.islice(streams.position_steps(itertools.count(), r, 2, 3, False), 4))
              for r in (0, 1)]
    assert [len(s) for steps in firsts for s in steps] == [3] * 8
    assert sorted(i for steps in firsts for s in steps for i in s) == list(range(24))


@pytest.fixture
def patched_loader():
    init, iterate = DataLoader.__init__, DataLoader.__iter__
    yield
    DataLoader.__init__, DataLoader.__iter__ = init, iterate


def test_a_stream_is_split_when_it_trains_and_read_whole_under_no_grad(patched_loader):
    made = loaders.install(TwoRanks(rank=1, world_size=2), "global")
    loader = DataLoader(SizedSharded(20), batch_size=4)
    trained = [[int(i) for b in loader for i in b] for _ in range(2)]
    with torch.no_grad():
        evaluated = [int(i) for b in loader for i in b]
    assert trained == [list(range(1, 20, 2))] * 2 and len(loader) == 5
    assert evaluated == list(range(20)) and made == [None]


def test_a_datapipe_is_left_to_the_dataloader_which_shards_it_over_the_ranks_itself():
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(8)).sharding_filter()
    env = TwoRanks(rank=0, world_size=2)
    assert loaders.sharded_arguments({"dataset": pipe, "batch_size": 2}, rank=0, world_size=2,
                                     mode="global", agree=int, env=env) is None


def test_a_webdataset_without_a_nodesplitter_is_refused_in_one_line_with_its_fixes():
    class WebDataset(IterableDataset):  # webdataset's single_node_only, as it raises
        def __iter__(self):
            raise ValueError("you need to add an explicit nodesplitter to your input pipeline "
                             "for multi-node training")
            yield

    with pytest.raises(UsageError) as e:
        loader_of(0, 2, WebDataset(), batch_size=4)
    assert str(e.value) == (
        "the script's WebDataset refuses to run on 2 processes without a nodesplitter "
        "(webdataset's single_node_only): give it nodesplitter=wds.split_by_node (each process "
        "then reads its own shards) or nodesplitter=None (--auto then splits its stream by "
        "position)")
