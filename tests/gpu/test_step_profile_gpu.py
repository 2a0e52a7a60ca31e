"""GPU tier for MULTIGPU_PROFILE_STEPS: the trace of this torch has the kernel events the numbers
are made of (their "cat" names, "args.stream", the NCCL kernels' names), under ddp and dp.

Run on a machine with 2+ GPUs:  pytest -m gpu tests/gpu/test_step_profile_gpu.py
"""
import collections
import json
import subprocess
import sys

import pytest
import torch

from tests.gpu.conftest import gpu_env
from tests.multiproc.conftest import REPO

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _profiled(tmp_path, *args) -> tuple[dict, str, dict]:
    out = tmp_path / "run"
    env = gpu_env() | {"MULTIGPU_PROFILE_STEPS": "5-9", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-m", "multigpu", "train", "--data", "digits", "--model", "cnn",
                           "--epochs", "1", "--logger", "none", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("profile of")]
    assert len(said) == 1, proc.stdout[-3000:]
    trace = json.loads((out / "profile" / "trace-rank0.json").read_text())
    return json.loads((out / "profile" / "rank0.json").read_text()), said[0], trace


def _kernels(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]


def test_a_ddp_profile_counts_the_kernels_streams_and_all_reduce_of_the_gpu(tmp_path):
    numbers, said, trace = _profiled(tmp_path, "--devices", "2")
    assert _kernels(trace) and all("stream" in e.get("args", {}) for e in _kernels(trace))
    assert said.startswith("profile of steps 5-9, rank 0: ") and " GPU busy " in said, said
    assert numbers["kernels_per_step"] > 0 and numbers["training_stream_ms"] > 0
    assert numbers["nccl_ms"] > 0, "the all-reduce's kernels: named nccl*"
    assert numbers["gpu_busy_ms"] <= numbers["step_ms"] * 1.1


def test_a_dp_profile_is_of_one_gpu(tmp_path):
    """dp: one process, both GPUs' kernels in its trace (pid: the device); the numbers are one GPU's."""
    numbers, said, trace = _profiled(tmp_path, "--strategy", "dp", "--devices", "0,1")
    assert len({e["pid"] for e in _kernels(trace)}) == 2, "both GPUs' kernels in the trace"
    assert " GPU busy " in said and numbers["kernels_per_step"] > 0
    assert numbers["gpu_busy_ms"] <= numbers["step_ms"] * 1.1
    per_gpu = collections.Counter(e["pid"] for e in _kernels(trace))
    assert round(numbers["kernels_per_step"] * 5) in per_gpu.values(), (numbers, per_gpu)
