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
from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import gpu_env

REPO = Path(__file__).resolve().parents[2]

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


LSTM = ["multigpu", "train", "--model", "lstm", "--data", "timeseries:macro", "--seq-length", "8",
        "--future-length", "{f}", "--batch-size", "16", "--epochs", "3", "--checkpoint-every", "0",
        "--deterministic"]


def _weights(run) -> dict:
    return torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)["model"]


def test_two_runs_share_gpu_0_forked_warm_with_the_results_of_runs_alone(tmp_path):
    """--runs-per-gpu 2 on one GPU: both runs on GPU 0 at once, forked from the warm process, and
    each ends with the weights of the same command run alone (tolerance: rtol 1e-5, atol 1e-7;
    bit-identical is expected with --deterministic, the tolerance only covers cuDNN's choices)."""
    env = gpu_env() | {"CUDA_VISIBLE_DEVICES": "0", "MULTIGPU_LEASE_DIR": str(tmp_path / "leases")}
    sweep = subprocess.run([sys.executable, "-m", "multigpu", "sweep", "--grid", "f=1,2",
                            "--runs-per-gpu", "2", "--out", "sw", "--", *LSTM],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert sweep.returncode == 0, sweep.stdout[-4000:] + sweep.stderr[-2000:]
    assert "1 GPU (0), 1 per run, up to 2 runs a GPU" in sweep.stdout
    states = [json.loads((tmp_path / "sw" / "state" / f"f={f}.json").read_text()) for f in (1, 2)]
    assert states[1]["started"] < states[0]["ended"] and states[0]["started"] < states[1]["ended"]
    for f in (1, 2):
        log = (tmp_path / "sw" / "logs" / f"f={f}.log").read_text()
        assert "forked from the sweep's warm process" in log and "1 GPU: 0 (NVIDIA" in log
        argv = [a.replace("{f}", str(f)) for a in LSTM[1:]]
        alone = subprocess.run([sys.executable, "-m", "multigpu", *argv, "--devices", "0,",
                                "--out", f"alone-{f}"], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=600)
        assert alone.returncode == 0, alone.stderr[-3000:]
        a, b = _weights(tmp_path / "sw" / "runs" / f"f={f}"), _weights(tmp_path / f"alone-{f}")
        assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a), f


def test_post002_sweep_finds_its_runs_a_gpu_from_the_peak_memory(tmp_path):
    """The 18 runs of examples/sweep_post002.yaml with the defaults: one run a GPU until the first
    epoch's max_memory_gib is in, then several; every run done."""
    env = gpu_env() | {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases")}
    sweep = subprocess.run([sys.executable, "-m", "multigpu", "sweep", "--out", "sw",
                            str(REPO / "examples" / "sweep_post002.yaml")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert sweep.returncode == 0, sweep.stdout[-4000:] + sweep.stderr[-2000:]
    line = next(ln for ln in sweep.stdout.splitlines() if "runs a GPU from now on" in ln)
    assert int(line.split("up to ")[1].split()[0]) > 1, line
    assert "finished: 18 done, 0 failed" in sweep.stdout
