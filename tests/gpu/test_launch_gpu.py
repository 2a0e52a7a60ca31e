"""GPU tier for the launcher: device choice and `multigpu gpus` on a machine with 2+ GPUs.

Run there with:  pytest -m gpu tests/gpu/test_launch_gpu.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multigpu.launcher import devices
from tests.gpu.conftest import gpu_env
from tests.multiproc.conftest import GPU_MACHINE_ENV

pytestmark = pytest.mark.gpu

SCRIPTS = Path(__file__).resolve().parents[1] / "multiproc" / "scripts"


def physical_gpus() -> list[devices.GpuInfo]:
    try:
        return devices.query_gpus()
    except devices.NvmlUnavailable:
        return []


@pytest.fixture
def gpus():
    found = physical_gpus()
    free = [g for g in found if devices.busy_reason(g, 2.0) is None]
    if len(found) < 2 or len(free) < 2:
        pytest.skip(f"needs 2 free GPUs, found {len(found)} GPUs, {len(free)} free")
    return found


def multigpu(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300):
    base = gpu_env()
    return subprocess.run([sys.executable, "-m", "multigpu", *args], cwd=cwd,
                          env=base | (env or {}), capture_output=True, text=True, timeout=timeout)


def reports(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def uuid_of(info: devices.GpuInfo) -> str:
    return info.uuid.removeprefix("GPU-")


def test_two_ranks_on_two_distinct_gpus(tmp_path, gpus):
    r = multigpu("run", "--devices", "2", str(SCRIPTS / "gpu_report.py"), str(tmp_path),
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    seen = reports(tmp_path)
    assert sorted(seen) == [0, 1]
    assert len({s["uuid"] for s in seen.values()}) == 2  # distinct physical GPUs
    assert {s["uuid"] for s in seen.values()} <= {uuid_of(g) for g in gpus}
    assert {s["sum"] for s in seen.values()} == {2.0}  # NCCL all_reduce over both
    assert "2 GPUs:" in r.stderr


def test_busy_gpu0_is_skipped_by_devices_1(tmp_path, gpus):
    ready = tmp_path / "hog_ready"
    env = dict(os.environ) | GPU_MACHINE_ENV | {"CUDA_VISIBLE_DEVICES": "0",
                                                "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    hog = subprocess.Popen([sys.executable, str(SCRIPTS / "gpu_hog.py"), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert hog.poll() is None and time.monotonic() < deadline, "the GPU hog did not start"
            time.sleep(0.5)
        r = multigpu("run", "--devices", "1", str(SCRIPTS / "gpu_report.py"), str(tmp_path),
                     cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-4000:]
        (seen,) = reports(tmp_path).values()
        assert seen["uuid"] != uuid_of(gpus[0]), "ran on the busy GPU 0"
        assert seen["uuid"] == uuid_of(gpus[1])  # the first free GPU
        # naming the busy GPU is a one-line error that suggests a free one
        r = multigpu("run", "--devices", "0,", str(SCRIPTS / "gpu_report.py"), str(tmp_path),
                     cwd=tmp_path)
        assert r.returncode == 2 and "GPU 0 is busy" in r.stderr and "--devices 1," in r.stderr
    finally:
        hog.kill()
        hog.wait(30)


def test_user_cuda_visible_devices_is_respected(tmp_path, gpus):
    r = multigpu("run", "--devices", "1", str(SCRIPTS / "gpu_report.py"), str(tmp_path),
                 cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    (seen,) = reports(tmp_path).values()
    assert seen["uuid"] == uuid_of(gpus[1]) and seen["visible"] == "1"
    assert "CUDA_VISIBLE_DEVICES=1" in r.stderr


def test_gpus_json_lists_every_gpu(tmp_path, gpus):
    r = multigpu("gpus", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)["gpus"]
    assert [g["index"] for g in listed] == [g.index for g in gpus]
    assert all(g["name"] and g["memory_total_mib"] > 0 for g in listed)
    r = multigpu("gpus", cwd=tmp_path, env={"COLUMNS": "200"})  # the table, wide enough not to wrap a name
    assert r.returncode == 0 and gpus[0].name in r.stdout
