"""A prepared loader with workers serves epoch after epoch from one DataLoader iterator: the next
epoch's first batches are asked for before the current epoch's last is handed out, with the same
batches, order and augmentation as a fresh iterator per epoch; a resume or an epoch left before
its end starts afresh, ending the old workers."""
import os
import time

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from multigpu.core.loading.data import ShardedBatchSampler
from multigpu.core.loading.loaders import PerSampleSeed, shard_loader

N, BATCH, SEED = 40, 4, 3  # 10 steps an epoch; 2 workers x prefetch_factor 2 ask 4 batches ahead


class Recorded(Dataset):
    """A sample: its index, one draw of torch's global RNG (an augmentation, as torchvision's),
    and the process that made it. Each call appends "pid index" to `log`, if given."""

    def __init__(self, log=None):
        self.log = log

    def __len__(self):
        return N

    def __getitem__(self, i):
        if self.log is not None:
            with open(self.log, "a") as f:  # one short write in append mode: lines never mix
                f.write(f"{os.getpid()} {i}\n")
        return torch.tensor([i]), torch.rand(1), torch.tensor([os.getpid()])


def prepared(dataset, workers, shuffle=True, persistent=False):
    return shard_loader(DataLoader(dataset, batch_size=BATCH, shuffle=shuffle, num_workers=workers,
                                   persistent_workers=persistent),
                        layout=(1, 0, 1), device=torch.device("cpu"),
                        seed=SEED, on_step=lambda info: None)


def todays_epoch(workers, shuffle, epoch, start=0):
    """One epoch as the loader made it before: a DataLoader iterator of its own per epoch."""
    sampler = ShardedBatchSampler(N, BATCH, shuffle=shuffle, seed=SEED)
    served = Recorded()
    if workers:
        served, sampler.tag_epoch = PerSampleSeed(served, SEED), True
    sampler.set_epoch(epoch, start)
    return [values(b) for b in DataLoader(served, batch_sampler=sampler, num_workers=workers)]


def values(batch):
    index, draw, _ = batch
    return index.flatten().tolist(), draw.flatten().tolist()


def pids(batches):
    return {p for _, _, pid in batches for p in pid.flatten().tolist()}


def ended(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle,last,worker_sets", [
    (True, None, 1),   # a training loader, as a script prepares it
    (False, 2, 1),     # multigpu train's: told its last epoch
    (False, None, 3),  # an evaluation loader: each pass afresh, as before
])
def test_epochs_through_one_iterator_equal_a_fresh_iterator_per_epoch(workers, shuffle, last, worker_sets):
    torch.manual_seed(0)
    expected = [todays_epoch(workers, shuffle, e) for e in range(3)]
    after_expected = torch.rand(1)
    torch.manual_seed(0)
    loader = prepared(Recorded(), workers, shuffle)
    if last is not None:
        loader.set_last_epoch(last)
    epochs = [list(loader) for _ in range(3)]
    assert [[values(b) for b in e] for e in epochs] == expected
    assert torch.rand(1) == after_expected, "the main process's random stream as before"
    if workers:
        served = [pids(e) for e in epochs]
        assert all(len(s) == workers for s in served)
        assert len(set.union(*served)) == workers * worker_sets


def test_the_next_epochs_first_samples_are_asked_for_before_this_epochs_last_batch(tmp_path):
    log = tmp_path / "calls"
    loader = prepared(Recorded(log), workers=2)
    for step, _ in enumerate(loader):
        if step == len(loader) - 1:  # epoch 0's last batch, in the caller's hands
            deadline = time.monotonic() + 30  # generous: the workers run on a loaded machine
            while len(log.read_text().splitlines()) <= N:
                assert time.monotonic() < deadline, "no sample of epoch 1 asked for by epoch 0's end"
                time.sleep(0.02)
    calls = [int(line.split()[1]) for line in log.read_text().splitlines()]  # before epoch 1 begins
    made_ahead = [i for k, i in enumerate(calls) if i in calls[:k]]  # a second time: epoch 1's
    first = [i for b in list(loader)[:4] for i in b[0].flatten().tolist()]  # epoch 1's first 4 batches
    assert made_ahead and set(made_ahead) <= set(first)


def test_the_last_epoch_asks_for_nothing_after_it_and_ends_its_workers(tmp_path):
    log = tmp_path / "calls"
    loader = prepared(Recorded(log), workers=2)
    loader.set_last_epoch(1)
    served = [pids(list(loader)) for _ in range(2)]
    assert served[0] == served[1], "one set of workers for both epochs"
    assert len(log.read_text().splitlines()) == 2 * N, "not one sample of an epoch 2"
    assert all(ended(pid) for pid in served[0]), "the workers end with the last epoch"


def test_a_last_epoch_changed_between_epochs_still_gives_every_epoch():
    loader = prepared(Recorded(), workers=2)
    loader.set_last_epoch(1)
    epochs = [list(loader)]
    loader.set_last_epoch(3)  # the iterator kept was planned to end with epoch 1
    epochs += [list(loader) for _ in range(3)]
    assert [[values(b) for b in e] for e in epochs] == [todays_epoch(2, True, e) for e in range(4)]
    assert pids(epochs[1]) == pids(epochs[2]) == pids(epochs[3]) != pids(epochs[0])


def test_a_resume_or_an_epoch_left_before_its_end_starts_afresh_and_ends_the_old_workers():
    loader = prepared(Recorded(), workers=2)
    first = pids(list(loader))  # epoch 0 whole: its workers already make epoch 1's first batches
    loader.set_epoch(0, 8)  # a resume inside epoch 0 (not the next epoch)
    resumed = list(loader)
    assert [values(b) for b in resumed] == todays_epoch(2, True, 0, start=8)
    assert all(ended(pid) for pid in first), "the iterator left behind ended its workers"
    second = pids(resumed)
    assert not second & first
    whole = list(loader)  # epoch 1: the new iterator goes on
    assert [values(b) for b in whole] == todays_epoch(2, True, 1) and pids(whole) == second
    for step, _ in enumerate(loader):  # epoch 2, left after 3 of its 10 batches
        if step == 2:
            break
    rest = list(loader)  # epoch 3, whole, from a fresh iterator
    assert [values(b) for b in rest] == todays_epoch(2, True, 3)
    assert all(ended(pid) for pid in second) and not pids(rest) & second


@pytest.mark.parametrize("persistent", [False, True])  # multigpu train's loaders are persistent
def test_workers_started_ahead_make_the_first_batches_before_the_first_iteration(tmp_path, persistent):
    def two_epochs(ahead, log=None):
        torch.manual_seed(0)
        loader = prepared(Recorded(log), workers=2, persistent=persistent)
        if ahead:
            assert loader.start_workers(1)
            deadline = time.monotonic() + 30  # generous: the workers run on a loaded machine
            while not log.exists() or len(log.read_text().splitlines()) < BATCH:
                assert time.monotonic() < deadline, "no sample made before the first iteration"
                time.sleep(0.02)
        else:
            loader.set_last_epoch(1)
        epochs = [list(loader) for _ in range(2)]
        return epochs, torch.rand(1)

    (expected, after_expected), log = two_epochs(False), tmp_path / "calls"
    epochs, after = two_epochs(True, log)
    assert [[values(b) for b in e] for e in epochs] == [[values(b) for b in e] for e in expected]
    assert [[values(b) for b in e] for e in epochs] == [todays_epoch(2, True, e) for e in range(2)]
    assert after == after_expected, "the main process's random stream as without the head start"
    assert pids(epochs[0]) == pids(epochs[1]), "the workers started ahead served both epochs"
    assert len(log.read_text().splitlines()) == 2 * N, "nothing past the last epoch"


def test_workers_started_ahead_of_a_resume_end_and_the_resume_gets_its_own_batches():
    torch.manual_seed(0)
    expected = todays_epoch(2, True, 0, start=8)
    after_expected = torch.rand(1)
    torch.manual_seed(0)
    loader = prepared(Recorded(), workers=2)
    assert loader.start_workers(None)
    ahead = loader._live._workers  # torch's iterator: the processes started ahead
    loader.set_epoch(0, 8)  # the run resumed inside epoch 0 after all
    resumed = list(loader)
    assert [values(b) for b in resumed] == expected
    assert torch.rand(1) == after_expected
    assert all(ended(w.pid) for w in ahead) and not pids(resumed) & {w.pid for w in ahead}


def test_a_loader_without_workers_or_already_iterated_starts_nothing_ahead():
    assert not prepared(Recorded(), workers=0).start_workers(1)
    loader = prepared(Recorded(), workers=2)
    list(loader)
    assert not loader.start_workers(1)
