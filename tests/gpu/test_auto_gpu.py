"""GPU tier for `multigpu run --auto`: the tutorial-style script of the CPU tests, unmodified, on
2 GPUs: each process on its own GPU (its only visible one), every training sample once per
epoch, one model.pt without `module.`, equal weights on both ranks.

Run there with:  pytest -m gpu tests/gpu/test_auto_gpu.py
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multigpu.launcher import devices
from tests.gpu.conftest import gpu_env

pytestmark = pytest.mark.gpu

TUTORIAL = Path(__file__).resolve().parents[1] / "multiproc" / "scripts" / "auto_tutorial.py"
MNIST_STYLE = Path(__file__).resolve().parent / "scripts" / "auto_mnist_style.py"


@pytest.fixture
def two_free_gpus():
    try:
        found = devices.query_gpus()
    except devices.NvmlUnavailable:
        found = []
    free = [g for g in found if devices.busy_reason(g, 2.0) is None]
    if len(free) < 2:
        pytest.skip(f"needs 2 free GPUs, found {len(found)} GPUs, {len(free)} free")


@pytest.mark.parametrize("wrap", [[], ["--dataparallel"]], ids=["bare", "dataparallel"])
def test_tutorial_script_on_two_gpus_each_process_on_its_own(tmp_path, two_free_gpus, wrap):
    r = subprocess.run([sys.executable, "-m", "multigpu", "run", "--auto", "--devices", "2",
                        str(TUTORIAL), "--batch", "8", "--epochs", "2", *wrap],
                       cwd=tmp_path, env=gpu_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    seen = {rank: json.loads((tmp_path / f"seen_rank{rank}.json").read_text()) for rank in (0, 1)}
    # each process saw one GPU, its own, and trained there ("cuda" and a DataParallel alike)
    assert [seen[k]["device_count"] for k in (0, 1)] == [1, 1]
    assert seen[0]["cuda_visible"] != seen[1]["cuda_visible"]
    assert [seen[k]["param_device"] for k in (0, 1)] == ["cuda:0", "cuda:0"]
    for epoch in (0, 1):
        order = [i for k in (0, 1) for e, idx in seen[k]["steps"] if e == epoch for i in idx]
        assert sorted(order) == list(range(48))
    assert [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("epoch ")] \
        == ["epoch 0", "epoch 1"]
    saved = torch.load(tmp_path / "model.pt", map_location="cpu")
    assert sorted(saved) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert seen[0]["weights"] == seen[1]["weights"]


def test_an_mnist_style_script_evaluates_its_shuffled_test_loader_whole(tmp_path, two_free_gpus):
    """On CUDA the script shuffles its test loader too; read under no_grad, it stays whole on each
    rank, so the accuracy printed counts all 300 samples; the whole model saved loads as Net."""
    r = subprocess.run([sys.executable, "-m", "multigpu", "run", "--auto", "--devices", "2",
                        str(MNIST_STYLE), "--epochs", "2"],
                       cwd=tmp_path, env=gpu_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    tests = [line for line in r.stdout.splitlines() if line.startswith("Test set: ")]
    assert [line.endswith("/300, evaluated 300") for line in tests] == [True, True], r.stdout
    assert int(tests[-1].split(": ")[2].split("/")[0]) > 150, r.stdout  # it learned
    assert "reloaded Net" in r.stdout and "multigpu: note:" not in r.stderr, r.stderr[-4000:]
    saved = torch.load(tmp_path / "mnist_cnn.pt", map_location="cpu")
    assert sorted(saved) == ["conv.bias", "conv.weight", "fc.bias", "fc.weight"]


def test_doctor_auto_finds_the_mnist_style_training_loader_split_on_two_gpus(tmp_path, two_free_gpus):
    """On CUDA the loaders' **kwargs shuffle: the reading leaves that to run time, and the run
    under --auto shows the training loader split (64 global = 32 per GPU, 16 steps per epoch)."""
    r = subprocess.run([sys.executable, "-m", "multigpu", "doctor", "--auto", "--devices", "2",
                        str(MNIST_STYLE)],
                       cwd=tmp_path, env=gpu_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert (f"ok    auto data      {MNIST_STYLE}:63: split by --auto: 16 batches per rank and "
            "epoch, each of its 1024 samples once over the 2 ranks") in r.stdout.splitlines()
    assert "32 samples per rank in the model's first forward; 64 over the 2 ranks" in r.stdout
    assert "was not split" not in r.stdout and not list(tmp_path.iterdir())


def test_nccl_joins_auto_processes_peer_to_peer_where_their_gpus_can(tmp_path, two_free_gpus):
    """--auto narrows each process to its own GPU (CUDA_VISIBLE_DEVICES); NCCL must still join
    their GPUs directly (P2P, over NVLink or PCIe) where the GPUs can reach each other, not
    through host memory (SHM): that would cost --auto on every all-reduce, against the same
    script run with every GPU visible (benchmarks/auto_public_scripts.py --compare, ddp)."""
    peers = subprocess.run([sys.executable, "-c", "import torch; n = torch.cuda.device_count(); "
                            "print(n > 1 and all(torch.cuda.can_device_access_peer(a, b) "
                            "for a in range(n) for b in range(n) if a != b))"],
                           env=gpu_env(), capture_output=True, text=True, timeout=120)
    if peers.stdout.strip() != "True":
        pytest.skip(f"the GPUs here do not all reach each other peer to peer: {peers.stdout}")
    env = gpu_env() | {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}
    r = subprocess.run([sys.executable, "-m", "multigpu", "run", "--auto", "--devices", "2",
                        str(TUTORIAL), "--batch", "8", "--epochs", "1"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    via = re.findall(r"NCCL INFO Channel \d+(?:/\d+)? : \S+ -> \S+ via (\S+)",
                     r.stdout + r.stderr)
    assert via and all(v.startswith("P2P") for v in via), sorted(set(via))


@pytest.mark.parametrize("script", ["auto_ema_unseeded.py", "auto_lbfgs_line_search.py"])
def test_an_ema_of_an_unseeded_model_and_an_lbfgs_line_search_agree_over_nccl(tmp_path,
                                                                               two_free_gpus, script):
    """Rank 0's weights sent when the optimizer gets them (NCCL, the model on its GPU already),
    and the loss of LBFGS's closure averaged over the ranks (a float64 all-reduce on the GPU):
    the same weights, and the same EMA, on both ranks; the line search ends alike on both."""
    r = subprocess.run([sys.executable, "-m", "multigpu", "run", "--auto", "--devices", "2",
                        str(TUTORIAL.parent / script)],
                       cwd=tmp_path, env=gpu_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    seen = [json.loads((tmp_path / f"weights_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0] == seen[1]
