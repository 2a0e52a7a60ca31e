"""--auto's pieces in this process, without a launcher: how a DataLoader is split (or left
whole), which modules an optimizer's gradients are averaged in, what torch.save writes, and
which GPU a process keeps."""
from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn
from torch.utils.data import (DataLoader, Dataset, RandomSampler,
                              SubsetRandomSampler, TensorDataset, WeightedRandomSampler)

from multigpu.auto import devices, gradients, notes
from multigpu.auto.data import loaders
from multigpu.auto.writes import saving
from multigpu.core.loading.data import ShardedBatchSampler
from multigpu.core.distributed import DistEnv
from multigpu.core.errors import UsageError

DATA = TensorDataset(torch.arange(48.0))


def split(rank=0, world=2, mode="global", **given):
    return loaders.sharded_arguments({"dataset": DATA} | given, rank=rank, world_size=world,
                                     mode=mode, agree=lambda seed: seed)


def epoch(sampler, e):
    sampler.set_epoch(e)
    return [i for batch in sampler for i in batch]


def test_a_shuffled_loader_is_split_every_sample_once_per_epoch():
    kwargs, s0 = split(0, batch_size=8, shuffle=True, num_workers=0)
    _, s1 = split(1, batch_size=8, shuffle=True)
    assert set(kwargs) == {"dataset", "num_workers", "batch_sampler"} and kwargs["batch_sampler"] is s0
    assert isinstance(s0, ShardedBatchSampler) and s0.batch_size == 4 and len(s0) == 6
    for e in (0, 1):
        assert sorted(epoch(s0, e) + epoch(s1, e)) == list(range(48))
    assert epoch(s0, 0) != epoch(s0, 1)


def test_loaders_without_shuffle_stay_whole():
    assert split(batch_size=8) is None
    assert split(batch_size=8, shuffle=False) is None


def test_a_subset_random_sampler_is_split_over_its_subset():
    subset = list(range(0, 48, 2))
    _, s0 = split(0, batch_size=4, sampler=SubsetRandomSampler(subset))
    _, s1 = split(1, batch_size=4, sampler=SubsetRandomSampler(subset))
    assert sorted(epoch(s0, 0) + epoch(s1, 0)) == subset
    _, whole = split(0, batch_size=4, sampler=RandomSampler(DATA))
    assert len(whole) == 12


def test_batch_size_is_the_global_batch_unless_per_gpu():
    with pytest.raises(UsageError) as e:
        split(batch_size=7, shuffle=True)
    assert str(e.value) == ("DataLoader(batch_size=7) cannot be split evenly over 2 processes: "
                            "--auto takes batch_size as the global batch, batch_size / 2 per "
                            "process; give a multiple of 2, or run with --auto-batch per-gpu to "
                            "keep 7 per process")
    assert split(batch_size=7, shuffle=True, mode="per-gpu")[1].batch_size == 7


def test_what_cannot_be_split_is_refused_in_one_line():  # a stream's: test_auto_streams.py
    with pytest.raises(UsageError, match=r"^the script gives its DataLoader a batch_sampler"):
        split(batch_sampler=[[0, 1]])
    with pytest.raises(UsageError, match=r"with replacement \(WeightedRandomSampler\)"):
        split(batch_size=4, sampler=WeightedRandomSampler([1.0] * 48, 48))


@pytest.fixture
def patched_loader():
    init, iterate = DataLoader.__init__, DataLoader.__iter__
    yield
    DataLoader.__init__, DataLoader.__iter__ = init, iterate


class RankZeroOfTwo(DistEnv):
    """Rank 0 of 2 without a process group: its seed is the one every rank gets."""

    def broadcast_object(self, obj, src=0):
        return obj


def test_each_new_pass_over_a_split_loader_is_the_next_epoch(patched_loader):
    loaders.install(RankZeroOfTwo(rank=0, world_size=2), "global")
    train = DataLoader(DATA, batch_size=8, shuffle=True)
    test = DataLoader(DATA, batch_size=8)
    first, second = ([int(i) for (x,) in train for i in x] for _ in range(2))
    assert len(train) == 6 and len(first) == len(set(first)) == 24 and first != second
    assert [int(i) for (x,) in test for i in x] == list(range(48))


def test_a_shuffled_loader_read_under_no_grad_is_evaluation_and_stays_whole(patched_loader):
    """pytorch/examples' MNIST gives its test loader shuffle=True on GPUs and evaluates it under
    torch.no_grad(), dividing by len(test_loader.dataset): split, each rank counts half."""
    loaders.install(RankZeroOfTwo(rank=0, world_size=2), "global")
    loader = DataLoader(DATA, batch_size=8, shuffle=True)
    with torch.no_grad():
        evaluated = sorted(int(i) for (x,) in loader for i in x)
    with torch.inference_mode():
        inferred = sorted(int(i) for (x,) in loader for i in x)
    trained = [[int(i) for (x,) in loader for i in x] for _ in range(2)]
    assert evaluated == inferred == list(range(48))
    assert [len(t) for t in trained] == [24, 24] and trained[0] != trained[1]
    assert trained[0] == epoch(split(0, batch_size=8, shuffle=True)[1], 0)  # no epochs passed


class WorkerGroups(Dataset):
    """Each sample: the pid and process group of the worker that read it, and the worker id that
    the script's worker_init_fn recorded there."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        import os
        return torch.tensor([os.getpid(), os.getpgid(0), _INIT_SEEN.get("worker", -1)])


_INIT_SEEN: dict = {}


def record_worker(worker_id):
    _INIT_SEEN["worker"] = worker_id


@pytest.mark.parametrize("context", [None, "spawn"])
def test_the_workers_of_a_split_loader_leave_the_ranks_process_group(patched_loader, context):
    """torchrun and a sweep stop a rank by signalling its process group: a worker in it died of
    the SIGTERM a script's own handler meant to finish its step on ("DataLoader worker ... exited
    unexpectedly"), as workers of the library's prepared loaders no longer do."""
    import os

    loaders.install(RankZeroOfTwo(rank=0, world_size=2), "global")
    loader = DataLoader(WorkerGroups(), batch_size=4, shuffle=True, num_workers=2,
                        worker_init_fn=record_worker, multiprocessing_context=context)
    rows = torch.cat(list(loader)).tolist()
    assert len(rows) == 8 and len({pid for pid, _, _ in rows}) == 2
    assert all(pgid == pid != os.getpgid(0) for pid, pgid, _ in rows), rows
    assert sorted({w for _, _, w in rows}) == [0, 1], "the script's worker_init_fn ran in each"
    if context:
        assert loader.multiprocessing_context.get_start_method() == context, "the script's kept"


@pytest.mark.parametrize("evaluation", ["no shuffle", "shuffled, under no_grad"])
def test_the_workers_of_a_whole_loader_leave_the_ranks_process_group_too(patched_loader, evaluation):
    """An evaluation loader (left whole) with workers: a stop sent to the rank's group during
    evaluation killed them, and the script's handler could not finish and save."""
    import os

    loaders.install(RankZeroOfTwo(rank=0, world_size=2), "global")
    loader = DataLoader(WorkerGroups(), batch_size=4, shuffle=evaluation != "no shuffle", num_workers=2,
                        worker_init_fn=record_worker)
    with torch.no_grad():
        rows = torch.cat(list(loader)).tolist()
    assert len(rows) == 16 and len({pid for pid, _, _ in rows}) == 2, "whole: every sample"
    assert all(pgid == pid != os.getpgid(0) for pid, pgid, _ in rows), rows
    assert sorted({w for _, _, w in rows}) == [0, 1]


@pytest.mark.parametrize("split_before", [0, 1])
def test_training_that_no_split_loader_feeds_is_said_at_the_first_step(capsys, split_before):
    """pytorch/examples' MNIST shuffles only on GPUs: on CPU processes its training loader stayed
    whole, every rank trained on all of it, and nothing said so."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(range(4))  # noqa: F841 - the training loader, without shuffle: alive
    notes.note_unsplit_training(RankZeroOfTwo(rank=0, world_size=2), [None] * split_before)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    note = ("multigpu: note: --auto: the script's first optimizer step came before any "
            "DataLoader with shuffle=True (or a RandomSampler): --auto splits only those, so "
            "each of the 2 processes trains on the same batches, the work of one process done "
            "2 times; give the training DataLoader shuffle=True\n")
    assert capsys.readouterr().err == ("" if split_before else note)


def test_gradients_are_averaged_in_the_outermost_module_that_holds_them():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    other = nn.Linear(3, 3)
    wrapped = nn.DataParallel(model)
    every = [model, model[0], model[2], other, wrapped]
    assert gradients.outermost_owners(list(model.parameters()), every) == [wrapped]
    both = gradients.outermost_owners([*model[0].parameters(), *other.parameters()], every)
    assert {id(m) for m in both} == {id(wrapped), id(other)}


def test_torch_save_strips_wrapper_prefixes_and_keeps_metadata():
    state = nn.DataParallel(nn.Sequential(nn.Linear(2, 2))).state_dict()
    clean = saving.without_prefixes(state)
    assert list(clean) == ["0.weight", "0.bias"]
    assert dict(clean._metadata) == {"": {"version": 1}, "0": {"version": 1}}
    nn.Sequential(nn.Linear(2, 2)).load_state_dict(clean)
    checkpoint = {"model": state, "epoch": 3}
    assert list(saving.without_prefixes(checkpoint)["model"]) == ["0.weight", "0.bias"]
    plain = collections.OrderedDict(w=torch.zeros(1))
    assert saving.without_prefixes(plain) is plain and saving.without_prefixes([1]) == [1]


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def saving_installed(monkeypatch):
    """saving.install's patches (torch.save, nn.Module.load_state_dict), undone after the test."""
    for owner, name in ((torch, "save"), (torch.serialization, "save"), (nn.Module, "load_state_dict")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    saving.install(DistEnv())


def test_torch_save_of_a_whole_replicated_model_writes_the_script_s_class(tmp_path, one_rank_group,
                                                                         saving_installed):
    """The PyTorch tutorial's `torch.save(model, PATH)`: pickling replicate's DDP<cls> failed
    (`Can't pickle <class '...replicate.DDPTiny'>`), and left a torn file at PATH."""
    from torch.distributed._composable import replicate

    model, part = Tiny(), Tiny()
    replicate(model)
    replicate(part.head)  # an optimizer of the head alone: a replicated child
    model(torch.ones(1, 2)).sum().backward()
    torch.save(model, tmp_path / "model.pt")
    torch.save({"model": part, "epoch": 3}, str(tmp_path / "part.pt"))
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(loaded) is Tiny and loaded.__dict__.keys() == Tiny().__dict__.keys()
    assert not loaded._forward_pre_hooks and not loaded._forward_hooks
    torch.testing.assert_close(loaded(torch.ones(4, 2)), model(torch.ones(4, 2)))
    head = torch.load(tmp_path / "part.pt", weights_only=False)["model"].head
    assert type(head) is nn.Linear and not head._forward_hooks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "part.pt", "store"]


def test_a_torch_save_that_fails_leaves_the_file_that_was_there(tmp_path, saving_installed):
    """One process's torch.save truncates PATH first: a save that fails midway (an object pickle
    cannot write) lost the script's previous file."""
    (tmp_path / "model.pt").write_bytes(b"the previous epoch's weights")
    with pytest.raises(Exception, match="lambda"):
        torch.save({"w": torch.ones(3), "schedule": lambda epoch: 0.1}, tmp_path / "model.pt")
    torch.save({"w": torch.ones(3)}, str(tmp_path / "new.pt"))
    assert (tmp_path / "model.pt").read_bytes() == b"the previous epoch's weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "new.pt"]
    assert torch.equal(torch.load(tmp_path / "new.pt")["w"], torch.ones(3))


def test_a_checkpoint_saved_without_prefixes_loads_back_into_the_script_s_dataparallel(tmp_path,
                                                                                     saving_installed):
    """pytorch/examples' ImageNet main.py saves `model.state_dict()` of its nn.DataParallel and
    its --resume loads that file into the same DataParallel: with the prefixes --auto strips,
    load_state_dict raised `Missing key(s) in state_dict: "module.0.weight", ...`."""
    trained = nn.DataParallel(nn.Sequential(nn.Linear(2, 3)))
    torch.save({"state_dict": trained.state_dict(), "epoch": 1}, tmp_path / "ckpt.pth")
    resumed = nn.DataParallel(nn.Sequential(nn.Linear(2, 3)))
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pth")["state_dict"])
    with pytest.raises(RuntimeError, match="Missing key"):  # a file that is not its own
        resumed.load_state_dict({"other.weight": torch.zeros(3, 2)})
    assert list(torch.load(tmp_path / "ckpt.pth")["state_dict"]) == ["0.weight", "0.bias"]
    torch.testing.assert_close(resumed.module[0].weight, trained.module[0].weight)


@pytest.mark.parametrize("visible, local_rank, own", [("2,5", "1", "5"), (None, "3", "3"),
                                                      ("GPU-a,GPU-b", "0", "GPU-a")])
def test_each_process_keeps_only_its_own_gpu(visible, local_rank, own):
    env = {"LOCAL_RANK": local_rank} | ({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible})
    assert devices.narrow_to_own_gpu(env) == own and env["CUDA_VISIBLE_DEVICES"] == own


def test_a_cpu_process_and_a_process_without_a_gpu():
    env = {"CUDA_VISIBLE_DEVICES": "", "LOCAL_RANK": "1"}
    assert devices.narrow_to_own_gpu(env) is None and env["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(UsageError, match=r"^process 2 on this machine has no GPU of its own"):
        devices.narrow_to_own_gpu({"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "2"})


def test_the_start_line_of_one_process_says_that_nothing_is_split():
    """`multigpu run --auto train.py` on a machine without GPUs starts one CPU process: its start
    line said "shuffled DataLoaders split ... gradients averaged", of which it did nothing."""
    from multigpu.auto import worker

    assert worker.start_line(1, None, "cpu", "global") == (
        "multigpu: --auto: 1 process, so the script runs as it is, with nothing to split or "
        "average; --devices N (GPUs) or --devices cpu:N (CPU processes) makes it data-parallel")
    assert worker.start_line(2, "gloo", "cpu", "per-gpu") == (
        "multigpu: --auto: 2 processes (gloo, cpu); shuffled DataLoaders split, the script's "
        "batch_size per process; gradients averaged as DDP does; the files it writes are rank 0's")


def test_a_deepcopy_or_a_whole_saved_copy_of_a_replicated_model_takes_hooks_again(
        tmp_path, one_rank_group, saving_installed):
    """An EMA copy or a model saved whole is a plain module that can be replicated again (a
    second optimizer, the next --auto run that loads it): replicate registers a forward pre-hook
    with kwargs, which failed on the copy ('cannot create weak reference to 'dict' object')."""
    from torch.distributed._composable import replicate
    from multigpu.auto.plain import plain_deepcopy

    model = Tiny()
    replicate(model)
    type(model).__deepcopy__ = plain_deepcopy  # as gradients.GradientAveraging does
    model(torch.ones(1, 2)).sum().backward()
    torch.save(model, tmp_path / "model.pt")
    for twin in (copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)):
        assert type(twin) is Tiny
        for hooks in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs"):
            assert type(getattr(twin, hooks)) is type(getattr(Tiny(), hooks)), hooks
        replicate(twin)
        twin(torch.ones(1, 2)).sum().backward()
        assert twin.head.weight.grad is not None


def test_the_unused_parameters_of_a_compiled_model_are_named_as_the_script_names_them(
        one_rank_group):
    """torch.compile's OptimizedModule holds the script's model as _orig_mod: the refusal names
    the script's class and parameters, not 'OptimizedModule' and '_orig_mod.head.weight'."""
    from torch.distributed._composable import replicate

    model = torch.compile(Tiny(), backend="eager")
    replicate(model)
    for p in model._orig_mod.body.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(UsageError) as refused:
        gradients.refuse_unused(model)
    assert str(refused.value).startswith(
        "2 trainable parameter(s) of the Tiny got no gradient in the first step (head.weight, "
        "head.bias): "), refused.value
