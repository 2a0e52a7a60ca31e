"""The --devices grammar and its error messages, on fake GPUs (this machine has none)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from multigpu.launcher import devices, leases
from multigpu.launcher.devices import GIB, DevicePlan, GpuInfo, resolve_devices
from multigpu.core.errors import UsageError
from tests.unit.test_leases import held_elsewhere


def gpu(index, used_gb=0.5, total_gb=80.0, procs=(), name="H200"):
    return GpuInfo(index, name, int(used_gb * GIB), int(total_gb * GIB), 0, list(procs),
                   uuid=f"GPU-{index:04d}-aaaa")


BUSY = [(4242, "python (alice)", 70 * GIB)]


@pytest.fixture
def fake_gpus(monkeypatch, tmp_path):
    """Install fake GPUs: fake_gpus(gpu(0), gpu(1, procs=BUSY)); no GPU: fake_gpus()."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv(leases.LEASE_DIR_ENV, str(tmp_path / "leases"))  # not this machine's
    monkeypatch.delenv(leases.HELD_ENV, raising=False)

    def install(*gpus):
        monkeypatch.setattr(devices, "query_gpus", lambda: list(gpus))

    return install


@pytest.fixture
def no_driver(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def fail():
        raise devices.NvmlUnavailable("NVML: NVML Shared Library Not Found")

    monkeypatch.setattr(devices, "query_gpus", fail)


# ------------------------------------------------------------------------------- grammar

@pytest.mark.parametrize("spec, kind, value", [
    ("auto", "auto", None), (" AUTO ", "auto", None), ("2", "count", 2), ("0,3", "ids", (0, 3)),
    ("1,", "ids", (1,)), ("cpu:4", "cpu", 4), ("cpu", "cpu", 1),
])
def test_grammar(spec, kind, value):
    assert devices.parse_devices(spec) == (kind, value)


@pytest.mark.parametrize("spec", ["gpu", "-1", "0;1", "1,,2", "cuda:0", "cpu:x", "2 GPUs", ""])
def test_bad_grammar_lists_the_four_forms(spec):
    with pytest.raises(UsageError) as e:
        devices.parse_devices(spec)
    msg = str(e.value)
    assert repr(spec) in msg and "auto" in msg and "0,3" in msg and "cpu:N" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("spec, fix", [("cuda:7", "--devices 7, for GPU 7)"),
                                       ("CUDA:0,3", "--devices 0,3 for GPUs 0,3)")])
def test_torch_s_name_of_a_gpu_gets_the_form_to_write(spec, fix):
    with pytest.raises(UsageError) as e:
        devices.parse_devices(spec)
    assert str(e.value).startswith(f"--devices {spec!r} is not understood (GPUs are named by "
                                   f"their index alone: write {fix}; use auto (every free GPU)")


def test_zero_is_not_gpu_zero():
    with pytest.raises(UsageError, match=r"--devices 0 asks for zero GPUs.*--devices 0, "):
        devices.parse_devices("0")


def test_cpu_zero():
    with pytest.raises(UsageError, match=r"--devices cpu:0: .*--devices cpu:1"):
        resolve_devices("cpu:0")


def test_duplicate_ids():
    with pytest.raises(UsageError, match=r"names a GPU twice.*--devices 0,1"):
        devices.parse_devices("1,0,1")


# ------------------------------------------------------------------------------- cpu

def test_cpu_plan_hides_gpus(fake_gpus):
    fake_gpus(gpu(0))
    plan = resolve_devices("cpu:3")
    assert plan == DevicePlan("cpu", (), 3)
    assert plan.cuda_visible_devices() == ""
    assert plan.describe() == "3 CPU processes (gloo)"


def test_cpu_one_process(fake_gpus):
    assert resolve_devices("cpu:1", one_process=True).nproc == 1
    with pytest.raises(UsageError, match="runs one process.*--devices cpu:1"):
        resolve_devices("cpu:2", one_process=True)


def test_auto_without_driver_is_one_cpu_process(no_driver):
    plan = resolve_devices("auto")
    assert (plan.accelerator, plan.nproc) == ("cpu", 1)
    assert "no GPU found" in plan.describe()


def test_gpu_request_without_gpu(no_driver):
    for spec in ("2", "0,1"):
        with pytest.raises(UsageError, match=r"has no GPU .*use --devices cpu:N"):
            resolve_devices(spec)


# ------------------------------------------------------------------------------- gpus

def test_auto_takes_every_free_gpu(fake_gpus):
    fake_gpus(gpu(0, procs=BUSY, used_gb=70), gpu(1), gpu(2, used_gb=79), gpu(3))
    plan = resolve_devices("auto")
    assert plan.gpu_ids == (1, 3) and plan.nproc == 2
    assert plan.cuda_visible_devices() == "1,3"
    assert plan.describe() == "2 GPUs: 1 (H200), 3 (H200)"


def test_count_skips_busy_gpu(fake_gpus):
    fake_gpus(gpu(0, procs=BUSY), gpu(1))
    plan = resolve_devices("1")
    assert plan.gpu_ids == (1,) and plan.cuda_visible_devices() == "1"


def test_our_own_process_does_not_make_a_gpu_busy(fake_gpus):
    import os

    fake_gpus(gpu(0, procs=[(os.getpid(), "python", GIB)]))
    assert resolve_devices("1").gpu_ids == (0,)


def test_count_larger_than_free(fake_gpus):
    fake_gpus(gpu(0, procs=BUSY, used_gb=70), gpu(1), gpu(2, used_gb=79.5), gpu(3))
    with pytest.raises(UsageError) as e:
        resolve_devices("3")
    msg = str(e.value)
    assert "--devices 3: only 2 of 4 GPUs are free" in msg
    assert "0 busy (pid 4242 python (alice), 70.0/80.0 GB used)" in msg
    assert "1 free" in msg and "2 busy (79.5/80.0 GB used)" in msg
    assert "use --devices 2" in msg


def test_count_larger_than_gpus(fake_gpus):
    fake_gpus(gpu(0), gpu(1))
    with pytest.raises(UsageError, match=r"--devices 4: this machine has 2 GPUs; use --devices 2"):
        resolve_devices("4")


def test_explicit_ids(fake_gpus):
    fake_gpus(gpu(0), gpu(1), gpu(2), gpu(3))
    plan = resolve_devices("0,3")
    assert plan.gpu_ids == (0, 3) and plan.cuda_visible_devices() == "0,3"
    assert resolve_devices("2,").gpu_ids == (2,)


def test_missing_gpu(fake_gpus):
    fake_gpus(gpu(0), gpu(1))
    with pytest.raises(UsageError) as e:
        resolve_devices("0,9")
    assert str(e.value) == ("--devices 0,9: GPU 9 does not exist: this machine has 2 GPUs (0, 1)")


def test_busy_explicit_gpu_suggests_free_ids(fake_gpus):
    fake_gpus(gpu(0, procs=BUSY), gpu(1), gpu(2), gpu(3, procs=BUSY))
    with pytest.raises(UsageError) as e:
        resolve_devices("0,3")
    msg = str(e.value)
    assert "GPU 0, 3 are busy" in msg and "0 busy (pid 4242" in msg and "1 free" in msg
    assert "use --devices 1,2" in msg and "--min-free-memory 0" in msg


def test_min_free_memory_zero_shares_busy_gpus(fake_gpus):
    fake_gpus(gpu(0, procs=BUSY, used_gb=79.9))
    assert resolve_devices("0,", min_free_memory_gb=0).gpu_ids == (0,)


def test_min_free_memory_threshold(fake_gpus):
    fake_gpus(gpu(0, used_gb=70), gpu(1, used_gb=10))
    assert resolve_devices("auto", min_free_memory_gb=20).gpu_ids == (1,)
    assert resolve_devices("auto", min_free_memory_gb=5).gpu_ids == (0, 1)


def test_no_free_gpu_for_auto(fake_gpus):
    fake_gpus(gpu(0, procs=BUSY))
    with pytest.raises(UsageError, match=r"--devices auto: no GPU is free: 0 busy"):
        resolve_devices("auto")


def test_one_process_drives_all_gpus(fake_gpus):
    fake_gpus(gpu(0), gpu(1))
    plan = resolve_devices("auto", one_process=True)
    assert plan.nproc == 1 and plan.gpu_ids == (0, 1)
    assert "one process drives them all" in plan.describe()


# ----------------------------------------------------------------------- CUDA_VISIBLE_DEVICES

def test_user_cuda_visible_devices_renumbers(fake_gpus, monkeypatch):
    fake_gpus(gpu(0), gpu(1), gpu(2, procs=BUSY), gpu(3))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    plan = resolve_devices("1")  # id 0 (physical 2) is busy: take id 1 = physical 3
    assert plan.gpu_ids == (1,) and plan.cuda_visible_devices() == "3"
    assert "CUDA_VISIBLE_DEVICES=2,3: physical 3" in plan.describe()
    with pytest.raises(UsageError) as e:
        resolve_devices("0,2")
    assert "GPU 2 does not exist: this machine has 2 GPUs (0, 1)" in str(e.value)
    assert "CUDA_VISIBLE_DEVICES='2,3' is set" in str(e.value)


def test_cuda_visible_devices_by_uuid(fake_gpus, monkeypatch):
    fake_gpus(gpu(0), gpu(1))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0001")
    plan = resolve_devices("auto")
    assert plan.gpu_ids == (0,) and plan.cuda_visible_devices() == "GPU-0001"


def test_empty_cuda_visible_devices_means_no_gpu(fake_gpus, monkeypatch):
    fake_gpus(gpu(0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert resolve_devices("auto").accelerator == "cpu"
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES hides every GPU"):
        resolve_devices("1")


def test_visible_list_stops_at_invalid_entry():
    gpus = [gpu(0), gpu(1)]
    assert [v.token for v in devices.visible_gpus(gpus, "1,-1,0")] == ["1"]
    assert [v.id for v in devices.visible_gpus(gpus, None)] == [0, 1]


# ------------------------------------------------------------------------------- leases

def test_a_gpu_leased_by_another_process_is_busy(fake_gpus):
    fake_gpus(gpu(0), gpu(1))
    with held_elsewhere(leases.gpu_key(gpu(0))) as proc:
        assert resolve_devices("1").gpu_ids == (1,)
        assert resolve_devices("auto").gpu_ids == (1,)
        with pytest.raises(UsageError) as e:
            resolve_devices("0,")
        msg = str(e.value)
        assert msg.startswith("--devices 0,: GPU 0 is busy")
        assert f"0 busy (leased by pid {proc.pid} (multigpu sweep sweeps/ts))" in msg
        assert "use --devices 1," in msg
        # --min-free-memory 0 shares on purpose: the lease is ignored, and none is taken
        plan = resolve_devices("0,", min_free_memory_gb=0)
        assert plan.gpu_ids == (0,)
        devices.lease(plan, "multigpu run x.py", 0)
        assert leases.holder(leases.gpu_key(gpu(0))) == f"pid {proc.pid} (multigpu sweep sweeps/ts)"


def test_a_gpu_a_sweep_leased_for_us_is_free(fake_gpus, monkeypatch):
    fake_gpus(gpu(0), gpu(1))
    with held_elsewhere(leases.gpu_key(gpu(1))):
        monkeypatch.setenv(leases.HELD_ENV, leases.gpu_key(gpu(1)))
        assert resolve_devices("auto").gpu_ids == (0, 1)


def _holder_seen_elsewhere(key):
    code = f"from multigpu.launcher import leases; print(leases.holder({key!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture
def kept(monkeypatch):
    """The leases this test kept until exit, released when it ends."""
    monkeypatch.setattr(leases, "_KEPT", [])
    yield leases._KEPT
    for lease in leases._KEPT:
        lease.release()


def test_the_chosen_gpus_are_leased_until_exit(fake_gpus, kept):
    fake_gpus(gpu(0), gpu(1), gpu(2))
    plan = resolve_devices("2")
    devices.lease(plan, "multigpu train runs/a", 2.0)
    me = os.getpid()
    assert _holder_seen_elsewhere(leases.gpu_key(gpu(0))) == f"pid {me} (multigpu train runs/a)"
    assert _holder_seen_elsewhere(leases.gpu_key(gpu(1))) == f"pid {me} (multigpu train runs/a)"
    assert _holder_seen_elsewhere(leases.gpu_key(gpu(2))) == "None"
    assert resolve_devices("1").gpu_ids == (0,)  # our own lease does not make a GPU busy to us


def test_a_gpu_taken_between_the_choice_and_the_lease(fake_gpus, kept):
    fake_gpus(gpu(0), gpu(1))
    plan = resolve_devices("2")
    with held_elsewhere(leases.gpu_key(gpu(1))) as proc:  # the race: taken after the choice
        with pytest.raises(UsageError) as e:
            devices.lease(plan, "multigpu train runs/a", 2.0)
    assert str(e.value) == (f"GPU 1 was just taken by pid {proc.pid} (multigpu sweep sweeps/ts); "
                            "run again, or pick other GPUs with --devices")
    assert kept == [] and _holder_seen_elsewhere(leases.gpu_key(gpu(0))) == "None"


def test_cpu_and_shared_plans_lease_nothing(fake_gpus, kept):
    fake_gpus(gpu(0))
    devices.lease(resolve_devices("cpu:2"), "multigpu run x.py", 2.0)
    devices.lease(resolve_devices("0,", min_free_memory_gb=0), "multigpu run x.py", 0)
    assert kept == [] and _holder_seen_elsewhere(leases.gpu_key(gpu(0))) == "None"


def test_more_cpu_processes_than_cores_are_said_crowded_with_the_count_that_fits(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert DevicePlan("cpu", (), 16).crowded() == (
        "16 CPU processes on 2 cores: they take turns, each slower than one process alone; use "
        "--devices cpu:2 or fewer")
    assert DevicePlan("cpu", (), 2).crowded() is None
    assert DevicePlan("cuda", (0, 1, 2), 3).crowded() is None
