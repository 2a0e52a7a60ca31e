"""GPU tier for --strategy fsdp (FSDP2).

One GPU: the NCCL/CUDA path on a one-rank mesh (bf16 with BatchNorm, fp16 with loss scaling,
fused AdamW on sharded parameters, CPU offload with activation checkpointing, save and load), and
a model whose state exceeds the GPU trained on it with CPU offload. Two GPUs: the same weights as ddp, a
model whose state does not fit one GPU under ddp trains, and a run resumes on one GPU.

Run:  make test-gpu   (pytest -m gpu tests/gpu)
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.multiproc.conftest import cli_env, multigpu as run_multigpu, read_metrics

pytestmark = pytest.mark.gpu
SCRIPTS = Path(__file__).parent / "scripts"
LIB = Path(__file__).parents[1] / "multiproc" / "lib_scripts"
one_gpu = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@one_gpu
@pytest.mark.parametrize("model, precision, extras, param_dtype", [
    ("resnet18", "bf16", "", "None"),       # BatchNorm: fp32 parameters, autocast computes in bf16
    ("swin_t", "fp16", "", "torch.float16"),  # no BatchNorm: fp16 parameters, loss scaling
    ("swin_t", "bf16", "offload,recompute", "torch.bfloat16"),  # shards in host memory
])
def test_fsdp_steps_save_and_load_on_one_gpu(model, precision, extras, param_dtype):
    done = subprocess.run([sys.executable, SCRIPTS / "fsdp_steps.py", model, precision, extras],
                          env=cli_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    assert result["units"] > 4 and result["param_dtype"] == param_dtype
    offload = "offload" in extras
    assert result["parameters_on"] == ("cpu" if offload else "cuda")
    assert result["optimizer_fused"] is (None if offload else True)  # foreach on the CPU
    if "recompute" in extras:
        assert "activation checkpointing" in result["strategy"]
    assert result["last_loss"] < 0.5 * result["first_loss"]
    assert result["skipped"] < 5
    assert result["optimizer_states"] == result["parameters"] > 0  # AdamW: a state for each
    assert result["same_weights_after_load"] and result["same_optimizer_after_load"]
    assert result["eval_loss_reloaded"] == result["eval_loss"]


@one_gpu
@pytest.mark.timeout(700)
def test_a_model_whose_state_exceeds_the_gpu_memory_it_may_use_trains_with_cpu_offload(tmp_path):
    # 24 GiB allowed of the card (torch's per-process fraction): ~1.7 billion parameters, whose
    # AdamW steps on the CPU take seconds; the whole card would need 5-9 billion and minutes.
    proc = run_multigpu("run", "--devices", "1", "--log-dir", tmp_path,
                        SCRIPTS / "fsdp_offload_big.py", "1.05", "24", timeout=650)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    assert result["ddp_state_gib"] > result["gpu_gib"]  # ddp (or single) could not hold it
    assert result["peak_gpu_gib"] < 0.5 * result["gpu_gib"]
    assert "CPU offload" in result["strategy"]
    assert result["losses"] and all(math.isfinite(loss) for loss in result["losses"]), result["losses"]


@two_gpus
def test_fsdp_on_two_gpus_ends_with_the_weights_of_ddp(tmp_path):
    states = {}
    for strategy in ("ddp", "fsdp"):
        out = tmp_path / f"{strategy}.pt"
        proc = run_multigpu("run", "--devices", "2", "--log-dir", tmp_path / strategy,
                            LIB / "fsdp_train.py", strategy, 2, out, "--accelerator", "cuda")
        assert proc.returncode == 0, proc.stderr[-4000:]
        states[strategy] = torch.load(out, weights_only=True)["model"]
    for key, value in states["ddp"].items():
        assert torch.allclose(value, states["fsdp"][key], rtol=1e-4, atol=1e-5), key


@two_gpus
def test_a_model_whose_state_exceeds_one_gpu_trains_under_fsdp_on_two(tmp_path):
    proc = run_multigpu("run", "--devices", "2", "--log-dir", tmp_path, SCRIPTS / "fsdp_big.py",
                        timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    assert result["ddp_state_gib"] > result["gpu_gib"]  # ddp would need more than the GPU has
    assert max(result["peak_gib_per_gpu"]) < 0.9 * result["gpu_gib"]
    assert result["losses"] and all(math.isfinite(loss) for loss in result["losses"]), result["losses"]


@two_gpus
def test_train_resnet50_under_fsdp_on_two_gpus_then_resume_on_one(tmp_path):
    common = ["--model", "resnet50", "--data", "synthetic:2048", "--image-size", "64",
              "--batch-size", "64", "--precision", "bf16"]
    out = tmp_path / "run"
    proc = run_multigpu("train", *common, "--epochs", "1", "--devices", "2", "--strategy", "fsdp",
                        "--out", out, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "fsdp (2 processes, nccl, 14 shard units)" in proc.stdout
    proc = run_multigpu("train", *common, "--epochs", "2", "--devices", "1", "--resume", out,
                        timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "saved by 2 x fsdp" in proc.stdout
    assert [r["train_samples"] for r in read_metrics(out)] == [2048, 2048]
