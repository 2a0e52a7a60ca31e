"""Library scripts through `multigpu run` on CPU/gloo: the traps the library catches."""
import json
from pathlib import Path

import pytest

from .conftest import multigpu

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).parent / "lib_scripts"


def test_unused_parameter_is_named_with_the_fix_at_the_first_step(tmp_path):
    proc = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path, SCRIPTS / "unused_parameter.py")
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "initial.weight, initial.bias" in output
    assert "find_unused_parameters=True" in output
    assert "Expected to have finished reduction" not in output  # DDP's cryptic error never comes


def test_unused_parameter_run_finishes_with_find_unused(tmp_path):
    proc = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path,
                    SCRIPTS / "unused_parameter.py", "--find-unused")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished" in proc.stdout


@pytest.mark.parametrize("procs", [1, 3])
def test_metrics_count_every_sample_once(tmp_path, procs):
    out = tmp_path / "metrics.json"
    proc = multigpu("run", "--devices", f"cpu:{procs}", "--log-dir", tmp_path / "logs",
                    SCRIPTS / "exact_metrics.py", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == {"accuracy": pytest.approx(5 / 7), "mean": pytest.approx(3.0), "seen": 7.0,
                      "world_size": procs}
