"""GPU tier of the unattended-run promise: faults caused on a ResNet-50 run over 2 GPUs (NCCL).

Run there with:  pytest -m gpu tests/gpu/test_unattended_gpu.py
(On CPU the same faults are tested bit for bit in tests/multiproc/test_faults.py; here cuDNN's
kernel choice makes weights differ in the last bits, so these tests check completeness.)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from multigpu.checkpoint_store import CheckpointStore

pytestmark = pytest.mark.gpu

N = 4096
ARGS = ["--model", "resnet50", "--data", f"synthetic:{N}", "--image-size", "96", "--epochs", "2",
        "--batch-size", "64", "--workers", "2", "--checkpoint-every", "10", "--devices", "2"]


@pytest.fixture(autouse=True)
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def start(out: Path, *extra) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.Popen([sys.executable, "-m", "multigpu", "train", *ARGS, "--out", str(out),
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(out: Path, proc: subprocess.Popen, timeout=240) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        entries = CheckpointStore(out / "checkpoints").entries() if (out / "checkpoints" / "manifest.json").exists() else []
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
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.count("resumed from") == 1
    assert [(r["epoch"], r["train_samples"]) for r in records(out)] == [(1, N), (2, N)]


def test_sigterm_on_gpus_saves_and_resume_finishes(tmp_path):
    out = tmp_path / "stopped"
    proc = start(out)
    wait_for_checkpoint(out, proc)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM" in stdout + stderr and "is complete" in stdout + stderr
    resumed = start(out, "--resume", str(out))
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout
    assert [(r["epoch"], r["train_samples"]) for r in records(out)] == [(1, N), (2, N)]
