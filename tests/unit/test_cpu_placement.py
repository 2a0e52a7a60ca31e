"""The CPU placement of a GPU rank (core/system/cpu_placement.py): exact CPU sets on made-up
machines, the machine's sibling lists read as the kernel writes them, and --cpu-placement's
application (train/cpu_placing.py): on CUDA alone, with the line it says."""
from __future__ import annotations

import os
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch

from torch.utils.data import DataLoader

from multigpu import setup
from multigpu.core.system.cpu_placement import (Placement, Topology, cpu_list, parse_cpu_list,
                                                plan_placement, read_siblings)
from multigpu.train import training
from multigpu.train.cpu_placing import place_main_thread
from multigpu.train.settings.config import TrainConfig

SIXTEEN = frozenset(range(16))
APART = [{k, k + 8} for k in range(8)]         # siblings (k, k+8): most x86 servers
ADJACENT = [{2 * k, 2 * k + 1} for k in range(8)]  # siblings (2k, 2k+1)


def _plan(allowed, siblings, gpu_local=None, rank=0, ranks=1):
    return plan_placement(allowed, siblings, gpu_local, rank, ranks)


def test_one_rank_keeps_a_whole_core_and_gives_the_workers_the_other_seven():
    assert _plan(SIXTEEN, APART) == Placement((0, 8), (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15),
                                              "unknown")
    assert _plan(SIXTEEN, ADJACENT) == Placement((0, 1), tuple(range(2, 16)), "unknown")
    # every CPU local to the one GPU: the share is its node's
    assert _plan(SIXTEEN, APART, [SIXTEEN]).numa == "share"


def test_cores_of_one_thread_keep_two_of_them_for_the_main_and_autograd_threads():
    assert _plan(range(8), []) == Placement((0, 1), (2, 3, 4, 5, 6, 7), "unknown")
    siblings_missing = [{cpu} for cpu in range(8)]
    assert _plan(range(8), siblings_missing) == Placement((0, 1), (2, 3, 4, 5, 6, 7), "unknown")


def test_only_the_allowed_cpus_count_and_a_core_with_one_allowed_sibling_is_one_thread():
    allowed = {0, 1, 2, 3, 9, 10, 11}  # 8 is not ours: core (0, 8) has one thread here
    assert _plan(allowed, APART) == Placement((0, 1, 9), (2, 3, 10, 11), "unknown")


def test_four_ranks_on_two_numa_nodes_share_out_each_node_between_its_two_gpus():
    """32 CPUs, 16 cores (k, k+16); node 0: cores 0-7, node 1: cores 8-15; GPUs 0, 1 on node 0,
    GPUs 2, 3 on node 1."""
    allowed = range(32)
    siblings = [{k, k + 16} for k in range(16)]
    node0 = frozenset([*range(0, 8), *range(16, 24)])
    node1 = frozenset([*range(8, 16), *range(24, 32)])
    local = [node0, node0, node1, node1]
    plans = [plan_placement(allowed, siblings, local, rank, 4) for rank in range(4)]
    assert [(p.main, p.workers, p.numa) for p in plans] == [
        ((0, 16), (1, 2, 3, 17, 18, 19), "share"),
        ((4, 20), (5, 6, 7, 21, 22, 23), "share"),
        ((8, 24), (9, 10, 11, 25, 26, 27), "share"),
        ((12, 28), (13, 14, 15, 29, 30, 31), "share")]
    # the GPUs' nodes unknown: every core shared out among the four, in order
    unknown = [plan_placement(allowed, siblings, None, rank, 4) for rank in range(4)]
    assert [(p.main, p.workers) for p in unknown] == [
        ((0, 16), (1, 2, 3, 17, 18, 19)), ((4, 20), (5, 6, 7, 21, 22, 23)),
        ((8, 24), (9, 10, 11, 25, 26, 27)), ((12, 28), (13, 14, 15, 29, 30, 31))]
    assert {p.numa for p in unknown} == {"unknown"}


def test_cores_that_do_not_divide_evenly_go_to_the_first_ranks():
    plans = [_plan(range(10), [], rank=r, ranks=2) for r in range(2)]  # 10 one-thread cores
    assert [(p.main, p.workers) for p in plans] == [((0, 1), (2, 3, 4)), ((5, 6), (7, 8, 9))]
    eleven = [_plan(range(11), [], rank=r, ranks=2) for r in range(2)]
    assert [(p.main, p.workers) for p in eleven] == [((0, 1), (2, 3, 4, 5)), ((6, 7), (8, 9, 10))]


def test_one_rank_on_two_nodes_keeps_every_core_and_its_main_thread_on_its_gpus_node():
    node1 = frozenset([*range(4, 8), *range(12, 16)])
    assert _plan(SIXTEEN, APART, [node1]) == Placement(
        (4, 12), (0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15), "main")


def test_too_few_cores_for_the_workers_make_no_plan():
    assert _plan(range(4), APART[:0] + [{0, 2}, {1, 3}]) is None  # 2 cores: 1 for the workers
    assert _plan(range(3), []) is None  # 3 one-thread cores: 2 kept, 1 left
    assert _plan({0, 1, 2, 8, 9, 10}, APART) == Placement((0, 8), (1, 2, 9, 10), "unknown")
    assert _plan(SIXTEEN, APART, rank=3, ranks=4) is None  # 2 cores a rank
    assert _plan(range(2), []) is None  # this test machine


def test_a_gpu_whose_node_is_unknown_shares_out_every_core():
    node0 = frozenset([*range(0, 4), *range(8, 12)])
    plans = [_plan(SIXTEEN, APART, [node0, None], rank=r, ranks=2) for r in range(2)]
    assert [(p.main, p.workers, p.numa) for p in plans] == [
        ((0, 8), (1, 2, 3, 9, 10, 11), "unknown"), ((4, 12), (5, 6, 7, 13, 14, 15), "unknown")]


def test_cpu_lists_are_read_and_written_as_the_kernel_does():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert cpu_list([9, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15]) == "1-7,9-15"
    assert cpu_list([0, 8]) == "0,8" and cpu_list([4, 5]) == "4,5" and cpu_list([3]) == "3"


def test_sibling_lists_are_read_from_sysfs_and_a_missing_one_leaves_its_cpu_alone(tmp_path):
    for cpu, text in ((0, "0,2\n"), (1, "1,3\n"), (2, "0,2\n")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text)
    assert read_siblings([0, 1, 2, 3, 4], tmp_path) == (
        frozenset({0, 2}), frozenset({1, 3}), frozenset({4}))


# --------------------------------------------------------------------------- applying it

FAKE = Topology(SIXTEEN, tuple(frozenset(g) for g in APART), None)  # main (0, 8): cpu 0 here


def _in_a_thread(work):
    """work()'s result and its thread's CPUs afterwards: pinning a thread of its own leaves
    pytest's main thread as it was."""
    out, threads = {}, torch.get_num_threads()
    thread = threading.Thread(target=lambda: out.update(result=work(), cpus=os.sched_getaffinity(0)))
    thread.start()
    thread.join()
    torch.set_num_threads(threads)
    return out["result"], out["cpus"]


def _cfg(placement: str) -> TrainConfig:
    return TrainConfig.from_flat(model="mlp", data="synthetic:64", cpu_placement=placement)


def test_a_cpu_rank_is_never_pinned():
    rt = setup("single", "fp32", accelerator="cpu", seed=0)
    before = os.sched_getaffinity(0)
    assert _in_a_thread(lambda: place_main_thread(_cfg("auto"), rt, FAKE)) == (None, before)


def test_a_cuda_rank_with_auto_pins_its_main_thread_and_says_where(capsys):
    rt = SimpleNamespace(device=torch.device("cuda", 0),
                         env=SimpleNamespace(rank=0, local_rank=0, local_world_size=1))
    before = os.sched_getaffinity(0)
    assert _in_a_thread(lambda: place_main_thread(_cfg("off"), rt, FAKE)) == (None, before)
    placed, cpus = _in_a_thread(lambda: place_main_thread(_cfg("auto"), rt, FAKE))
    assert placed == Placement((0, 8), (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15), "unknown")
    assert cpus == {0}  # of (0, 8): this machine has no cpu 8
    assert capsys.readouterr().out.splitlines() == [
        "cpu placement: rank 0 main thread on cpus 0,8; 14 loader workers on cpus 1-7,9-15 "
        "(cuda:0's NUMA node unknown)"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _in_a_thread(lambda: (place_main_thread(_cfg("auto"), rt, FAKE), DataLoader(range(4), num_workers=14)))
    # torch's check of 14 workers against the main thread's one CPU here: not said
    assert [str(w.message) for w in seen if "worker processes" in str(w.message)] == []
    capsys.readouterr()
    no_workers = TrainConfig.from_flat(model="mlp", data="synthetic:64", cpu_placement="auto", workers=0)
    assert _in_a_thread(lambda: place_main_thread(no_workers, rt, FAKE)) == (None, before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_the_run_s_loader_workers_run_on_the_placement_s_worker_cpus():
    """build_job with a placement: one worker per worker CPU by default, each running there
    (started from a thread that may use every CPU)."""
    rt = setup("single", "fp32", accelerator="cpu", seed=0)
    spare = max(os.sched_getaffinity(0))
    placement = Placement((0,), (spare,), "unknown")
    job = training.build_job(TrainConfig.from_flat(model="mlp", data="synthetic:64", batch_size=8), rt,
                             placement=placement)
    assert job.plan.workers == 1 and job.plan.cpu_placement == {"main": "0", "workers": str(spare),
                                                                "numa": "unknown"}
    it = iter(job.train_loader.loader)
    next(it)
    assert [os.sched_getaffinity(w.pid) for w in it._workers] == [{spare}]
    del it
