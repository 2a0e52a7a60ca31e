"""GPU tier of the optimizer kernels (training.kernel_options): every --optimizer under every
--strategy takes steps on GPUs, where CUDA's fused kernels run, and `multigpu bench` gives its
multigpu-ddp and multigpu-fsdp rows (fsdp's default SGD once ended in "aten._fused_sgd_.default
does not have a sharding strategy registered").

Run:  pytest -m gpu tests/gpu/test_optimizers_gpu.py
"""
import json
import math
import re

import pytest
import torch

from tests.multiproc.conftest import multigpu as run_multigpu, read_metrics

pytestmark = pytest.mark.gpu
STRATEGY_DEVICES = {"single": "1", "dp": "0,1", "ddp": "2", "fsdp": "2"}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("strategy", STRATEGY_DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_each_optimizer_trains_under_each_strategy(tmp_path, strategy, optimizer):
    out = tmp_path / "run"
    proc = run_multigpu("train", "--model", "resnet18", "--data", "digits", "--epochs", "1",
                        "--batch-size", "128", "--strategy", strategy, "--optimizer", optimizer,
                        "--devices", STRATEGY_DEVICES[strategy], "--out", out, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    (record,) = read_metrics(out)
    assert record["train_samples"] == 1442
    assert math.isfinite(record["train_loss"]) and math.isfinite(record["val_loss"]), record


def table_cells(stdout: str) -> dict[str, dict[str, str]]:
    """The bench table's rows, by method: {method: {column: cell}} (rich draws ┃ in the header,
    │ in the body)."""
    header = next(line for line in stdout.splitlines() if "┃" in line and "img/s" in line)
    names = [c.strip() for c in header.strip().strip("┃").split("┃")]
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == len(names) and cells[0].startswith("multigpu-"):
            rows[cells[0]] = dict(zip(names, cells))
    return rows


@pytest.mark.parametrize("gpus", [2, 4])
def test_bench_gives_the_ddp_and_fsdp_rows(tmp_path, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    out = tmp_path / "bench.json"
    proc = run_multigpu("bench", "--model", "resnet18", "--methods", "multigpu-ddp,multigpu-fsdp",
                        "--devices", str(gpus), "--gpus", str(gpus), "--batch-size", "32",
                        "--image-size", "32", "--steps", "5", "--warmup", "2", "--trials", "1",
                        "--out", out, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    rows = table_cells(proc.stdout)
    assert set(rows) == {"multigpu-ddp", "multigpu-fsdp"}, proc.stdout[-3000:]
    for cells in rows.values():
        assert re.fullmatch(r"[\d,]+", cells["img/s"]) and int(cells["img/s"].replace(",", "")) > 0, cells
    saved = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert "foreach" in saved["multigpu-fsdp"]["optimizer"], saved["multigpu-fsdp"]
    assert "fused" in saved["multigpu-ddp"]["optimizer"], saved["multigpu-ddp"]
