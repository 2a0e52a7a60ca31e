"""`multigpu run --auto`: a model whose first forward runs under a tracer (tensorboard's
add_graph, torch.jit.trace, torch.export.export) before training, as in a one-device run: the
trace is the script's plain model at that moment, and training then averages its gradients."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.multiproc.test_run_cli import multigpu

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "auto_traced_model.py"


def traced_run(tmp_path: Path, how: str) -> list[dict]:
    r = multigpu("--auto", "--devices", "cpu:2", str(SCRIPT), "--how", how, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = [json.loads((tmp_path / f"traced_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0]["weights"] == seen[1]["weights"]  # gradients averaged after the trace
    assert seen[0]["expected"] == seen[1]["expected"]  # rank 0's weights traced on both
    return seen


@pytest.mark.parametrize("how", ["jit", pytest.param("export", marks=pytest.mark.extended)])
def test_a_model_traced_before_training_traces_its_weights_then_trains_data_parallel(tmp_path, how):
    for rank in traced_run(tmp_path, how):
        torch.testing.assert_close(torch.tensor(rank["traced"]), torch.tensor(rank["expected"]))
        assert rank["class"] == "Net"  # the script's class, not replicate's DDPNet
        if how == "jit":  # also traced: a Sequential holding the model, its bound forward
            for key in ("held", "method"):
                torch.testing.assert_close(torch.tensor(rank[key]), torch.tensor(rank["expected"]))
            # the traced module holds the model's weights, trained with it
            torch.testing.assert_close(torch.tensor(rank["traced_after"]),
                                       torch.tensor(rank["model_after"]))


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="no tensorboard")
@pytest.mark.extended  # a second test of its change; the default tier keeps the first
def test_tensorboard_add_graph_before_training_writes_the_scripts_graph(tmp_path):
    traced_run(tmp_path, "tensorboard")
    events = list((tmp_path / "runs" / "traced").glob("events.out.tfevents.*"))
    assert events and all(b"Net/Linear[hidden]" in e.read_bytes() for e in events)
