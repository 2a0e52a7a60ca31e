"""`multigpu run --auto` on 2 CPU processes of a script with BatchNorm: its statistics are over
the global batch, as in one process (auto/batchnorm.py), not over each process's half."""
from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

from tests.multiproc.test_run_cli import multigpu

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "auto_batchnorm.py"


@pytest.mark.parametrize("compiled", [
    [], pytest.param(["--compile"], marks=pytest.mark.extended)], ids=["eager", "compiled"])
def test_batchnorm_trains_on_the_global_batchs_statistics_as_one_process(tmp_path, compiled):
    """Weights, running statistics and eval outputs equal one process's on the same global
    batches of 8, on both processes (each normalizing its 4 alone ends 1e-1 away); under
    torch.compile too (there the ranks' running statistics were 0.4 apart)."""
    r = multigpu("--auto", "--devices", "cpu:2", str(SCRIPT), *compiled, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"seen_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["weights"] == ranks[1]["weights"] and ranks[0]["eval"] == ranks[1]["eval"]

    one = runpy.run_path(str(SCRIPT))
    data = one["Images"]()
    torch.manual_seed(0)
    model = one["make_model"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for a, b in zip(ranks[0]["steps"], ranks[1]["steps"]):
        assert len(a) == len(b) == 4
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(data.x[a + b]), data.y[a + b]).backward()
        optimizer.step()
    assert len(ranks[0]["steps"]) == 12, "48 samples, a global batch of 8, 2 epochs"
    for key, value in model.state_dict().items():  # float32 sums in another order
        torch.testing.assert_close(torch.tensor(ranks[0]["weights"][key]), value.to(torch.float32)
                                   if value.is_floating_point() else value, rtol=0, atol=1e-5)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(ranks[0]["eval"]), model(data.x[:4]), rtol=0,
                                   atol=1e-5)
