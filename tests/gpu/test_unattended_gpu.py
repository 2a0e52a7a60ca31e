"""GPU tier of the unattended-run promise: faults caused on a ResNet-50 run over 2 GPUs (NCCL).

Run there with:  pytest -m gpu tests/gpu/test_unattended_gpu.py
(On CPU the same faults are tested bit for bit in tests/multiproc/test_faults.py; here cuDNN's
kernel choice makes weights differ in the last bits, so these tests check completeness.)
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from multigpu.train.checkpoints.checkpoint_store import CheckpointStore
from tests.gpu.conftest import gpu_env
from tests.multiproc.conftest import track

pytestmark = pytest.mark.gpu

N = 2048
ARGS = ["--model", "resnet50", "--data", f"synthetic:{N}", "--image-size", "64", "--epochs", "2",
        "--batch-size", "64", "--workers", "2", "--checkpoint-every", "10", "--devices", "2"]


@pytest.fixture(autouse=True)
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def start(out: Path, *extra, args=ARGS) -> subprocess.Popen:
    """The launcher, its output in files beside the run (kept when a test times out)."""
    env = gpu_env()
    out.parent.mkdir(parents=True, exist_ok=True)
    n = len(list(out.parent.glob(f"{out.name}-launch*.out")))
    proc = subprocess.Popen([sys.executable, "-m", "multigpu", "train", *args, "--out", str(out),
                             "--hang-timeout", "60", *extra], env=env, text=True,
                            stdout=open(out.parent / f"{out.name}-launch{n}.out", "w"),
                            stderr=open(out.parent / f"{out.name}-launch{n}.err", "w"))
    track(proc)
    return proc


def output(out: Path, proc: subprocess.Popen, timeout=240) -> tuple[str, str]:
    proc.wait(timeout)
    n = len(list(out.parent.glob(f"{out.name}-launch*.out"))) - 1
    return ((out.parent / f"{out.name}-launch{n}.out").read_text(),
            (out.parent / f"{out.name}-launch{n}.err").read_text())


def wait_for_checkpoint(out: Path, proc: subprocess.Popen, timeout=240) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, output(out, proc)[1][-3000:]
        saved = (out / "checkpoints" / "manifest.json").exists()
        entries = CheckpointStore(out / "checkpoints").entries() if saved else []
        if entries:
            return entries[-1].global_step
        time.sleep(0.1)
    raise AssertionError("no checkpoint in time")


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_kill_9_of_one_gpu_worker_restarts_and_resumes(tmp_path):
    out = tmp_path / "killed"
    proc = start(out, "--max-restarts", "1")
    wait_for_checkpoint(out, proc)
    workers = [p for p in psutil.Process(proc.pid).children() if "train" in " ".join(p.cmdline())]
    assert len(workers) == 2
    workers[1].kill()
    stdout, stderr = output(out, proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.count("resumed from") == 1
    assert [(r["epoch"], r["train_samples"]) for r in records(out)] == [(1, N), (2, N)]


# One long epoch: 1500 steps a rank. SIGTERM goes as soon as the first checkpoint (step 300) is
# complete; a stop waits for the ranks' next exchange (about 1 s, control.CHECK_SECONDS), while the
# 1200 steps left take several seconds even at 5 ms a step. (2 epochs of 16 steps once finished
# inside the 1 s the test slept, on H100s.)
LONG_N = 64 * 2 * 1500
LONG_ARGS = ["--model", "resnet50", "--data", f"synthetic:{LONG_N}", "--image-size", "64",
             "--epochs", "1", "--batch-size", "64", "--workers", "2", "--checkpoint-every", "300",
             "--devices", "2"]


def test_sigterm_on_gpus_saves_and_resume_finishes(tmp_path):
    out = tmp_path / "stopped"
    proc = start(out, args=LONG_ARGS)
    first = wait_for_checkpoint(out, proc)  # training steps are running: signal at once
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = output(out, proc, timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    stop = re.search(r"stopped by SIGTERM in epoch 1, (\d+) samples in, step (\d+): checkpoint .* "
                     r"is complete", stdout + stderr)
    assert stop, (stdout + stderr)[-3000:]
    position, step = int(stop[1]), int(stop[2])
    assert 0 < position < LONG_N and step >= first, (first, position, step)
    saved = CheckpointStore(out / "checkpoints").entries()[-1]
    assert (saved.global_step, saved.run["position"]) == (step, position)
    resumed = start(out, "--resume", str(out), args=LONG_ARGS)
    stdout, stderr = output(out, resumed)
    assert resumed.returncode == 0, stderr[-3000:]
    assert f"{position} of {LONG_N} samples in" in stdout
    assert [(r["epoch"], r["train_samples"]) for r in records(out)] == [(1, LONG_N)]


def test_a_hang_on_nccl_is_named_and_the_flight_recorder_dumped(tmp_path):
    env = gpu_env()
    began = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "multigpu", "run", "--devices", "2", "--hang-timeout", "15",
                        "--log-dir", str(tmp_path), str(Path(__file__).parent / "scripts" / "skip_allreduce_nccl.py")],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 124, r.stderr[-3000:]
    assert time.monotonic() - began < 15 + 60
    assert "rank 1: stuck" in r.stderr and "in after_skipping" in r.stderr
    assert "rank 0: stuck" in r.stderr and "skip_allreduce_nccl.py:2" in r.stderr  # line 23 or 24
    for rank in (0, 1):
        assert (tmp_path / f"hang-rank{rank}.txt").stat().st_size > 0
    trace = tmp_path / "nccl_trace_rank0.pkl"
    assert trace.is_file() and trace.stat().st_size > 0, sorted(p.name for p in tmp_path.iterdir())
    print(r.stderr[-1500:])
    print("flight recorder:", {p.name: p.stat().st_size for p in tmp_path.glob("nccl_trace*")})
