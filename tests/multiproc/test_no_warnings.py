"""A normal run shows no warning from torch: the demo's DDP run, with FutureWarning and
UserWarning turned into errors in the launcher and in every worker (they inherit PYTHONWARNINGS)."""
import subprocess
import sys

import pytest

from .conftest import cli_env, read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.smoke
def test_ddp_demo_run_raises_no_future_or_user_warning(tmp_path):
    env = cli_env()
    env["PYTHONWARNINGS"] = "error::FutureWarning,error::UserWarning"
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "multigpu", "train", "--model", "cnn", "--data", "digits",
         "--epochs", "1", "--devices", "cpu:2", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_metrics(out)[-1]["val_samples"] == 355  # it trained, on both ranks
    worker_logs = "".join(p.read_text() for p in (out / "logs").rglob("*.log"))
    for text in (done.stdout, done.stderr, worker_logs):
        assert "Warning" not in text
