"""Several runs a device: the pool's slots, its one lease per device handed to each run, and the
rule that finds K from a run's peak memory."""
import subprocess
import sys
import textwrap

import pytest

from multigpu.launcher import devices, leases
from multigpu.sweep import pool as pools

GIB = 2**30


def other_process_can_lease(key: str, lease_dir) -> bool:
    """Whether another process (as a second sweep or a train would) can lease `key` now."""
    code = textwrap.dedent(f"""
        import os
        os.environ["MULTIGPU_LEASE_DIR"] = {str(lease_dir)!r}
        from multigpu.launcher import leases
        print(leases.try_lease([{key!r}], "other") is not None)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() == "True"


def test_two_runs_share_a_core_and_its_lease_lasts_while_either_holds_it(monkeypatch, tmp_path):
    monkeypatch.setenv("MULTIGPU_LEASE_DIR", str(tmp_path))
    pool = pools.make_pool("cpu:1", "cpu:1", slots=2)
    assert pool.capacity() == 2 and "up to 2 runs a core" in pool.describe()
    (a, lease_a), (b, lease_b) = pool.take("sweep"), pool.take("sweep")
    assert [u.token for u in a + b] == ["0", "0"]
    assert pool.take("sweep") is None  # both slots taken
    assert not other_process_can_lease("cpu-0", tmp_path)
    pool.give_back(a)  # run a ended: b's run and the pool still hold it
    lease_a.release()
    assert not other_process_can_lease("cpu-0", tmp_path)
    pool.give_back(b)  # the pool lets go; the run's own copy (as after the sweep died) holds it
    assert not other_process_can_lease("cpu-0", tmp_path)
    lease_b.release()
    assert other_process_can_lease("cpu-0", tmp_path)


def test_runs_go_to_the_gpu_with_the_fewest_first(monkeypatch, tmp_path):
    monkeypatch.setenv("MULTIGPU_LEASE_DIR", str(tmp_path))
    gpus = [devices.GpuInfo(i, "H100", 0, 80 * GIB, uuid=f"GPU-{i}") for i in range(2)]
    monkeypatch.setattr(devices, "query_gpus", lambda: gpus)
    pool = pools.make_pool("auto", "1", slots=3)
    taken = [pool.take("sweep")[0][0].token for _ in range(6)]
    assert taken == ["0", "1", "0", "1", "0", "1"] and pool.take("sweep") is None
    env = pool.environment([pool.units[0]])
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env[leases.HELD_ENV] == "gpu-GPU-0"


def test_auto_k_starts_at_one_and_follows_the_peak_memory(monkeypatch, tmp_path):
    monkeypatch.setenv("MULTIGPU_LEASE_DIR", str(tmp_path))
    gpus = [devices.GpuInfo(i, "H100", 0, 80 * GIB, uuid=f"GPU-{i}") for i in range(4)]
    monkeypatch.setattr(devices, "query_gpus", lambda: gpus)
    monkeypatch.setattr(pools.os, "sched_getaffinity", lambda _pid: set(range(64)), raising=False)
    pool = pools.make_pool("auto", "1")
    assert (pool.slots, pool.capacity()) == (1, 4)  # nothing measured yet: one run a GPU
    pool.learn_peak(0.05)  # a small LSTM: 16 cores a GPU bound it, not the memory
    assert (pool.slots, pool.capacity()) == (16, 64)
    pool.learn_peak(10)  # a larger run: K follows the largest peak seen, 78 / (1.25 x 10 + 1)
    pool.learn_peak(0.05)
    assert pool.slots == 5
    assert pools.make_pool("auto", "2").slots_given == 1  # runs of 2 GPUs are not packed


@pytest.mark.parametrize("peak, total, min_free, cores, k", [
    (0.05, 80, 2, 16, 16),   # bound by the cores
    (10, 80, 2, 64, 5),      # 78 GiB / (1.25 x 10 + 1) = 5.8
    (100, 80, 2, 16, 1),     # does not fit twice: one
    (1.0, 2, 2, 16, 1),      # no room past --min-free-memory: still one
])
def test_auto_slots_rule(peak, total, min_free, cores, k):
    assert pools.auto_slots(peak, total, min_free, cores) == k


def test_only_cpu_cores_shared_by_several_runs_get_the_line_about_taking_turns():
    assert pools.make_pool("cpu:1", "cpu:1", slots=1).shared_cores() is None
    assert pools.make_pool("cpu:1", "cpu:1").shared_cores() is None
    assert pools.make_pool("cpu:1", "cpu:1", slots=3).shared_cores().startswith(
        "--runs-per-gpu 3 on CPU cores: 3 runs take turns on each core")
