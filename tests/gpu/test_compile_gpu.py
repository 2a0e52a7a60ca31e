"""GPU tier for --compile reduce-overhead (CUDA graphs): on 2 GPUs where there are, else on 1.

Run on a machine with GPUs:  make test-gpu   (pytest -m gpu tests/gpu)
"""
import json
from pathlib import Path

import pytest
import torch

from tests.multiproc.conftest import multigpu as run_multigpu, read_metrics

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
GPUS = str(min(2, torch.cuda.device_count()))


def test_cuda_graphs_under_ddp_train_as_eager_does(tmp_path):
    script = Path(__file__).resolve().parents[1] / "multiproc" / "lib_scripts" / "cuda_graphs.py"
    proc = run_multigpu("run", "--devices", GPUS, "--log-dir", tmp_path, script, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["world_size"] == int(GPUS) and result["skips"] == 0, result
    # a new function is run once before it is recorded: here the forward and backward of the
    # first shape, and the evaluation (the one step of the 7-sample batch is never recorded)
    assert result["graphs"] >= 3, result
    assert result["across_ranks"] == 0, "DDP keeps the ranks' weights identical"
    assert result["max_weight_diff"] < 1e-5 and result["max_stats_diff"] < 1e-5, result  # 1.5e-7, 3e-7 on an H200
    eager, compiled = result["eval_losses"]
    assert abs(eager - compiled) < 0.01 * eager, result


def test_train_with_cuda_graphs_counts_every_sample_and_saves_a_plain_checkpoint(tmp_path):
    out = tmp_path / "graphs"
    proc = run_multigpu("train", "--model", "cnn", "--data", "digits", "--epochs", "3",
                        "--devices", GPUS, "--compile", "reduce-overhead", "--out", out, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    records = read_metrics(out)
    assert [r["train_samples"] for r in records] == [1442] * 3  # with a partial last batch
    assert records[-1]["val_samples"] == 355 and records[-1]["val_accuracy"] > 0.9
    assert json.loads((out / "config.json").read_text())["compile"] == "reduce-overhead"
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert not any(k.startswith(("_orig_mod", "module")) for k in state), list(state)[:3]
