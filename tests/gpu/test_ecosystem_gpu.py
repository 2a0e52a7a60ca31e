"""GPU tier for what a run leaves to read and the self-test, on one GPU (the first one):
no warning from torch in a normal run, GPU memory in metrics.jsonl, TensorBoard and curves.png,
and `multigpu test` passing on the GPU.

Run there with:  pytest -m gpu tests/gpu/test_ecosystem_gpu.py
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from PIL import Image

from tests.gpu.conftest import gpu_env
from tests.multiproc.conftest import read_metrics
from tests.unit.test_loggers import scalars

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def multigpu(*args, cwd, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "multigpu", *map(str, args)], cwd=cwd,
                          env=gpu_env() | (env or {}), capture_output=True, text=True, timeout=timeout)


def test_a_one_gpu_run_warns_nothing_and_logs_memory_to_tensorboard(tmp_path):
    out = tmp_path / "run"
    done = multigpu("train", "--model", "cnn", "--data", "digits", "--epochs", "2", "--devices", "0,",
                    "--precision", "bf16", "--log-every", "10", "--out", out, cwd=tmp_path,
                    env={"PYTHONWARNINGS": "error::FutureWarning,error::UserWarning"})
    assert done.returncode == 0, done.stderr[-3000:]
    logs = "".join(p.read_text() for p in (out / "logs").rglob("*.log")) if (out / "logs").is_dir() else ""
    for text in (done.stdout, done.stderr, logs):
        assert "Warning" not in text
    epochs = read_metrics(out)
    assert len(epochs) == 2 and all(0 < e["max_memory_gib"] < 80 for e in epochs)
    seen = scalars(out)
    assert [v for _, v in seen["perf/max_memory_gib"]] == pytest.approx([e["max_memory_gib"] for e in epochs])
    assert len(seen["train/loss"]) >= 4 and seen["val/accuracy"][-1][1] > 0.5
    with Image.open(out / "curves.png") as png:
        assert png.format == "PNG"


def test_the_self_test_passes_on_the_gpu(tmp_path):
    done = multigpu("test", "--devices", "0,", cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "cuda" in done.stdout and "FAIL" not in done.stdout
