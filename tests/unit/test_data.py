"""Exact sharding: every sample once per epoch, equal step counts on every rank, no empty batch."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from multigpu.core.loading.data import ShardedBatchSampler, plan_global_steps
from multigpu.core.loading.loaders import shard_loader
from multigpu.core.errors import UsageError


def epoch_indices(n, batch, ranks, devices=1, drop_last=False, shuffle=True, epoch=0):
    samplers = [ShardedBatchSampler(n, batch, num_ranks=ranks, rank=r, devices_per_rank=devices,
                                    shuffle=shuffle, seed=7, drop_last=drop_last) for r in range(ranks)]
    for s in samplers:
        s.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


@pytest.mark.parametrize("n,batch,ranks", [(8607, 4, 4), (8605, 4, 4), (10, 3, 4), (7, 1, 4),
                                           (100, 8, 3), (5, 5, 1), (4097, 1, 4)])
def test_every_sample_exactly_once_and_equal_steps(n, batch, ranks):
    samplers, per_rank = epoch_indices(n, batch, ranks)
    steps = {len(batches) for batches in per_rank}
    assert len(steps) == 1, "every rank must run the same number of steps"
    flat = [i for batches in per_rank for b in batches for i in b]
    assert sorted(flat) == list(range(n))
    assert all(len(b) >= 1 for batches in per_rank for b in batches), "no empty batch on any rank"
    assert samplers[0].num_samples == n


def test_posts_case_last_step_is_split_not_padded():
    # 8607 samples, batch 4 per process, 4 processes: 537 full steps of 16, then 15 -> 4,4,4,3.
    _, per_rank = epoch_indices(8607, 4, 4)
    assert [len(b[-1]) for b in per_rank] == [4, 4, 4, 3]
    assert len(per_rank[0]) == 538


def test_remainder_smaller_than_devices_is_merged_into_previous_step():
    # 8609 = 538 * 16 + 1: one sample left for 4 ranks -> it joins the step before.
    _, per_rank = epoch_indices(8609, 4, 4)
    assert len(per_rank[0]) == 538
    assert [len(b[-1]) for b in per_rank] == [5, 4, 4, 4]


def test_last_step_gives_every_device_two_samples_when_it_can():
    # 8612 = 538 * 16 + 4: one sample each would break BatchNorm on 1x1 maps -> merged instead.
    _, per_rank = epoch_indices(8612, 4, 4)
    assert len(per_rank[0]) == 538 and [len(b[-1]) for b in per_rank] == [5, 5, 5, 5]
    _, per_rank = epoch_indices(8616, 4, 4)  # 8 left: 2 each is enough
    assert len(per_rank[0]) == 539 and [len(b[-1]) for b in per_rank] == [2, 2, 2, 2]


def test_dataparallel_last_batch_never_smaller_than_gpu_count():
    # Trap 3: DataParallel over 4 GPUs, batch 1 per GPU: 8607 % 4 = 3 samples would leave GPU 3 idle.
    _, (batches,) = epoch_indices(8607, 1, 1, devices=4)
    assert min(len(b) for b in batches) >= 4
    assert sum(len(b) for b in batches) == 8607


@pytest.mark.parametrize("n", [8607, 8610, 8613, 90, 91, 1001])
def test_dataparallel_chunks_give_every_gpu_two_samples(n):
    # DataParallel splits with torch.chunk: 10 samples over 4 GPUs would be 3, 3, 3, 1.
    from multigpu.core.loading.data import chunk_sizes

    _, (batches,) = epoch_indices(n, 4, 1, devices=4)
    assert sum(len(b) for b in batches) == n
    for b in batches:
        sizes = chunk_sizes(len(b), 4)
        assert len(sizes) == 4 and min(sizes) >= 2, (len(b), sizes)


def test_drop_last_drops_the_partial_global_step():
    _, per_rank = epoch_indices(8607, 4, 4, drop_last=True)
    assert sum(len(b) for batches in per_rank for b in batches) == 537 * 16


def test_shuffle_differs_per_epoch_and_matches_across_ranks():
    s0, e0 = epoch_indices(100, 5, 2, epoch=0)
    s1, e1 = epoch_indices(100, 5, 2, epoch=1)
    assert e0 != e1
    assert torch.equal(s0[0].order(), s0[1].order())


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(UsageError, match="3 samples, fewer than the 4 that one step needs"):
        plan_global_steps(3, 4, 4, False)


def test_step_infos_give_window_counts_for_accumulation():
    s = ShardedBatchSampler(19, 2, num_ranks=2, rank=1, shuffle=False)  # steps of 4: 4, 4, 4, 7
    infos = s.step_infos(accumulate=3)
    assert [i.global_count for i in infos] == [4, 4, 4, 7]
    assert [i.window_count for i in infos] == [12, 12, 12, 7]
    assert [i.sync for i in infos] == [False, False, True, True]
    assert [i.local_count for i in infos] == [2, 2, 2, 3]


def test_prepared_loader_reshuffles_each_epoch_and_reports_steps():
    ds = TensorDataset(torch.arange(10).float(), torch.arange(10))
    seen = []
    loader = shard_loader(DataLoader(ds, batch_size=4, shuffle=True), layout=(1, 0, 1),
                          device=torch.device("cpu"), seed=0, on_step=seen.append)
    first = [y.tolist() for _, y in loader]
    second = [y.tolist() for _, y in loader]
    assert sorted(sum(first, [])) == list(range(10)) and first != second
    assert [i.local_count for i in seen[:3]] == [4, 4, 2]


def _prepare(loader):
    return shard_loader(loader, layout=(1, 0, 1),
                        device=torch.device("cpu"), seed=0, on_step=lambda info: None)


def test_subset_random_sampler_keeps_its_subset():
    from torch.utils.data import SubsetRandomSampler

    ds = TensorDataset(torch.arange(100))
    loader = _prepare(DataLoader(ds, batch_size=16, sampler=SubsetRandomSampler(range(80))))
    seen = sorted(i for (b,) in loader for i in b.tolist())
    assert seen == list(range(80)), "held-out samples 80-99 must never be trained on"


def test_samplers_that_cannot_be_sharded_exactly_are_refused():
    from torch.utils.data import WeightedRandomSampler

    ds = TensorDataset(torch.arange(10))
    with pytest.raises(UsageError, match="WeightedRandomSampler, which multigpu cannot shard"):
        _prepare(DataLoader(ds, batch_size=2, sampler=WeightedRandomSampler([1.0] * 10, 10)))


# --- resuming inside an epoch ----------------------------------------------------------------------

def _steps_from(n, batch, ranks, epoch, start):
    """Each global step's indices (all ranks) of `epoch` from position `start`."""
    samplers = [ShardedBatchSampler(n, batch, num_ranks=ranks, rank=r, shuffle=True, seed=7)
                for r in range(ranks)]
    for s in samplers:
        s.set_epoch(epoch, start)
    return [[i for part in step for i in part] for step in zip(*(list(s) for s in samplers))]


@pytest.mark.parametrize("n,batch,before,after,steps_done", [
    (1000, 8, 2, 1, 20), (1000, 8, 2, 3, 20), (8607, 4, 4, 3, 100), (205, 4, 2, 3, 25), (100, 8, 3, 2, 4)])
def test_resume_on_another_world_size_neither_repeats_nor_skips_a_sample(n, batch, before, after, steps_done):
    first = _steps_from(n, batch, before, epoch=3, start=0)[:steps_done]
    position = sum(len(s) for s in first)
    rest = _steps_from(n, batch, after, epoch=3, start=position)
    seen = [i for step in first + rest for i in step]
    assert sorted(seen) == list(range(n))
    full_order = ShardedBatchSampler(n, batch, shuffle=True, seed=7)
    full_order.set_epoch(3)
    assert seen == full_order.order().tolist(), "the epoch's order, continued where it stopped"


def test_resume_on_the_same_world_size_runs_the_uninterrupted_steps():
    whole = _steps_from(8607, 4, 4, epoch=1, start=0)
    position = sum(len(s) for s in whole[:300])
    assert _steps_from(8607, 4, 4, epoch=1, start=position) == whole[300:]


def test_resume_at_the_end_of_an_epoch_has_no_steps_left():
    assert _steps_from(100, 8, 2, epoch=0, start=100) == []


def test_a_prepared_loader_reports_and_restores_its_position():
    data = TensorDataset(torch.arange(50))
    seen = []

    def loader(ranks=1):
        return shard_loader(DataLoader(data, batch_size=4, shuffle=True), layout=(ranks, 0, 1),
                            device=torch.device("cpu"), seed=3, on_step=lambda i: None)

    a = loader()
    it = iter(a)
    for _ in range(5):
        seen += next(it)[0].tolist()
    state = a.state_dict()
    assert state == {"epoch": 0, "position": 20}
    b = loader()
    b.load_state_dict(state)
    assert len(b) == 8  # 30 samples left in steps of 4 (the last one of 6)
    rest = [i for (x,) in b for i in x.tolist()]
    assert sorted(seen + rest) == list(range(50))
    assert b.state_dict() == {"epoch": 1, "position": 0}
    assert len(b) == 13  # the next epoch is whole again


class RandomAugment(torch.utils.data.Dataset):
    """A sample's 'augmentation' is one draw from torch's global RNG, as torchvision's are."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.rand(1)


def _augmentations(workers, start=0):
    loader = shard_loader(DataLoader(RandomAugment(), batch_size=4, shuffle=True, num_workers=workers),
                          layout=(1, 0, 1), device=torch.device("cpu"),
                          seed=5, on_step=lambda i: None)
    loader.set_epoch(2, start)
    return {int(x): float(r) for xs, rs in loader for x, r in zip(xs.flatten(), rs.flatten())}


def test_augmentation_in_workers_depends_on_the_sample_not_on_workers_or_a_resume():
    two = _augmentations(2)
    assert len(set(two.values())) == 40, "still random from sample to sample"
    assert _augmentations(1) == two
    assert _augmentations(2, start=16) == {i: r for i, r in two.items() if i in _augmentations(1, start=16)}


class WorkerIdentity(torch.utils.data.Dataset):
    """The first batch, then a worker that sleeps in __getitem__: killed there, it holds none of
    the loader's locks (killed inside a queue's put or an fd handover, it would leave the rank
    blocked on a lock forever: torch's loader, not ours, seen once in CI)."""

    calls = 0

    def __len__(self):
        return 400

    def __getitem__(self, i):
        import os
        import time
        self.calls += 1  # the worker's own copy counts
        if self.calls > 4:
            time.sleep(120)
        return torch.tensor([os.getpid(), os.getpgid(0)])


def test_loader_workers_keep_out_of_the_ranks_process_group_but_die_on_sigterm():
    import os
    import signal
    import time

    import psutil

    loader = shard_loader(DataLoader(WorkerIdentity(), batch_size=4, num_workers=1,
                                     persistent_workers=True),
                          layout=(1, 0, 1), device=torch.device("cpu"),
                          seed=0, on_step=lambda i: None)
    it = iter(loader)
    pid, pgid = next(it)[0].tolist()
    assert pgid == pid != os.getpgid(0), "a group of its own: torchrun's killpg does not reach it"
    time.sleep(0.5)  # the worker is past its handover, asleep in its fifth __getitem__
    os.kill(pid, signal.SIGTERM)  # how torch ends a worker that does not stop by itself
    worker = psutil.Process(pid)
    deadline = time.monotonic() + 10
    # torch reports the death as "worker ... killed by signal" (from its SIGCHLD handler, which
    # may fire inside this loop) or "exited unexpectedly" at the next batch
    with pytest.raises(RuntimeError, match="DataLoader worker .*(killed by signal|exited unexpectedly)"):
        while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the worker outlived SIGTERM by 10 s"
            time.sleep(0.05)
        for _ in range(50):
            next(it)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


def test_per_sample_seeds_hold_behind_a_subset_too():
    from torch.utils.data import Dataset, Subset

    from multigpu.core.loading.loaders import PerSampleSeed

    class Noisy(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.rand(1)

    seeded = PerSampleSeed(Subset(Noisy(), list(range(10))), 7)  # a SubsetRandomSampler's shard
    batch = seeded.__getitems__([(0, 3), (0, 4)])
    assert [float(v) for v in batch] == [float(seeded[(0, 3)]), float(seeded[(0, 4)])]


def test_per_sample_seeding_draws_as_torch_manual_seed_and_queues_no_cuda_seeding():
    """A sample's draws are those of torch.manual_seed(its seed), exactly (augmentations kept),
    but seeding it queues no CUDA seeding for later: torch.manual_seed does that with a captured
    Python stack, 0.1 ms of a loader worker's time per sample (benchmarks/cpu_pipeline.py)."""
    import random

    import numpy as np
    from torch.utils.data import Dataset

    from multigpu.core.loading.loaders import PerSampleSeed, sample_seed

    class Draws(Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return torch.rand(3), torch.randint(1000, (2,)), random.random(), np.random.rand()

    seeded = PerSampleSeed(Draws(), 11)
    for index in range(5):
        s = sample_seed(11, 2, index)
        torch.manual_seed(s), random.seed(s), np.random.seed(s % 2**32)
        want = Draws()[index]
        got = seeded[(2, index)]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2:] == want[2:]
    if not torch.cuda.is_initialized():
        queued = torch.cuda._lazy_seed_tracker.get_calls()
        seeded[(2, 0)]
        assert torch.cuda._lazy_seed_tracker.get_calls() == queued


@pytest.mark.parametrize("method,epochs", [("default", 20), ("spawn", 3)])
def test_loader_workers_starting_while_sigterm_storms_the_group_do_not_die_of_it(method, epochs):
    """Workers that start after the stop signal to the group came (a sweep's or torchrun's stop in
    the first batches, or an epoch's start) must not die of it before the step is done."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "multiproc" / "scripts" / "loader_under_group_signals.py"
    proc = subprocess.Popen([sys.executable, str(script), method, str(epochs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # its own group
    try:
        out, err = proc.communicate(timeout=300)
    finally:  # the storm too, whatever became of the script
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-2000:]
    assert out.split() == [str(8 * epochs), "True"], "every batch, with signals coming"
