"""GPU tier of `multigpu sweep`, on the first GPU: a sweep of real train runs on one GPU each, and
the lease that keeps a `multigpu train` started by hand off the GPU a sweep's run is using.

Run there with:  pytest -m gpu tests/gpu/test_sweep_gpu.py
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import time

import pytest
import torch

from tests.gpu.conftest import gpu_env

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_a_sweep_on_one_gpu_keeps_a_hand_started_train_off_it(tmp_path):
    env = gpu_env() | {"CUDA_VISIBLE_DEVICES": "0", "MULTIGPU_LEASE_DIR": str(tmp_path / "leases")}
    sweep = subprocess.Popen(
        [sys.executable, "-m", "multigpu", "sweep", "--grid", "seed=1,2", "--devices-per-run", "1",
         "--out", "sw", "--", "multigpu", "train", "--model", "cnn", "--data", "digits",
         "--epochs", "4", "--precision", "bf16"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    state = tmp_path / "sw" / "state" / "seed=1.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        if state.exists() and json.loads(state.read_text())["status"] == "running":
            break
        time.sleep(0.1)
    by_hand = subprocess.run([sys.executable, "-m", "multigpu", "train", "--model", "mlp", "--data",
                              "digits", "--epochs", "1", "--devices", "1", "--out", "hand"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out, _ = sweep.communicate(timeout=600)
    assert sweep.returncode == 0, out[-4000:]
    assert by_hand.returncode == 2, by_hand.stdout + by_hand.stderr
    assert "leased by pid" in by_hand.stderr and "multigpu sweep" in by_hand.stderr, by_hand.stderr
    assert not (tmp_path / "hand").exists()
    with open(tmp_path / "sw" / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["seed"] for r in rows) == ["1", "2"]
    assert all(r["status"] == "done" and float(r["best_val_accuracy"]) > 0.8 for r in rows), rows
    for r in rows:
        config = json.loads((tmp_path / "sw" / "runs" / r["name"] / "config.json").read_text())
        assert config["devices"] == "1"
        assert "multigpu train: 1 GPU: 0 (NVIDIA" in (tmp_path / "sw" / "logs" / f"{r['name']}.log").read_text()
