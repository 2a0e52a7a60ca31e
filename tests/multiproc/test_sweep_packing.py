"""Small runs packed: K runs on one leased device, runs forked from the sweep's warm process with
the same results as runs alone, and a run killed there leaving the others (and the next runs)
unharmed. Real `multigpu sweep` and `multigpu train` processes on CPU."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from multigpu.launcher import leases

from .conftest import cli_env, read_metrics
from .test_sweep_cli import RECORDER, starts, summary_rows, sweep_popen

pytestmark = pytest.mark.slow

WARM = "forked from the sweep's warm process"
# A small LSTM: a few hundredths of a second an epoch here.
LSTM = ["multigpu", "train", "--model", "lstm", "--data", "timeseries:macro", "--seq-length", "8",
        "--future-length", "{f}", "--batch-size", "16", "--lr", "0.003", "--checkpoint-every", "0",
        "--logger", "csv", "--deterministic"]
# Ten times the data (about 0.2 s an epoch here), for many epochs: a run still has most of its
# work ahead when it is killed.
LONGER = [a.replace("macro", "co2") if a == "timeseries:macro" else a for a in LSTM]


@pytest.fixture
def recorder(tmp_path):
    path = tmp_path / "recorder.py"
    path.write_text(RECORDER)
    return path


def wait_for(check, what: str, seconds: float = 120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    pytest.fail(f"no {what} within {seconds} s")


def model_weights(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)["model"]


def test_two_runs_share_one_core_under_the_sweeps_lease(tmp_path, recorder):
    cmd = ["--grid", "v=1,2", "--devices", "cpu:1", "--devices-per-run", "cpu:1", "--runs-per-gpu",
           "2", "--out", "sw", "--", sys.executable, recorder, "{out}", "{v}"]
    lease_dir = tmp_path / "leases"
    sweep = sweep_popen(*cmd, cwd=tmp_path, env={"MULTIGPU_LEASE_DIR": str(lease_dir), "SLEEP": "3"})
    folder = tmp_path / "sw"
    wait_for(lambda: starts(folder, "v=1") and starts(folder, "v=2"), "start of both runs")
    os.environ["MULTIGPU_LEASE_DIR"] = str(lease_dir)
    try:
        assert f"pid {sweep.pid} (multigpu sweep" in (leases.holder("cpu-0") or "")
    finally:
        del os.environ["MULTIGPU_LEASE_DIR"]
    out, _ = sweep.communicate(timeout=120)
    assert sweep.returncode == 0, out
    assert "1 CPU core (0), 1 per run, up to 2 runs a core" in out
    (s1, e1, c1), (s2, e2, c2) = (json.loads((folder / "runs" / f"v={v}" / "record.json").read_text())
                                  for v in (1, 2))
    assert c1 == c2 == [0]
    assert s2 < e1 and s1 < e2  # at the same time


def test_runs_forked_from_the_warm_process_match_runs_alone_bit_for_bit(tmp_path):
    """--deterministic: the sweep's two runs (2 at once, forked) and the same two commands run
    alone (exec'd, one after another) end with equal weights and equal metrics."""
    env = {**cli_env(), "MULTIGPU_LEASE_DIR": str(tmp_path / "leases")}
    cmd = ["--grid", "f=1,2", "--devices", "cpu:2", "--devices-per-run", "cpu:1", "--out", "sw",
           "--", *LSTM, "--epochs", "2"]
    sweep = subprocess.run([sys.executable, "-m", "multigpu", "sweep", *cmd], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    for f in (1, 2):
        packed = tmp_path / "sw" / "runs" / f"f={f}"
        assert WARM in (tmp_path / "sw" / "logs" / f"f={f}.log").read_text()
        alone = tmp_path / f"alone-{f}"
        argv = [a.replace("{f}", str(f)) for a in LSTM[1:]]
        proc = subprocess.run([sys.executable, "-m", "multigpu", *argv, "--epochs", "2", "--devices",
                               "cpu:1", "--out", str(alone)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        a, b = model_weights(packed), model_weights(alone)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        keys = ("train_loss", "val_loss", "val_mae", "val_rmse")
        assert [[r[k] for k in keys] for r in read_metrics(packed)] == \
               [[r[k] for k in keys] for r in read_metrics(alone)]


def test_a_forked_run_killed_leaves_the_others_and_the_next_ones_finishing(tmp_path):
    """kill -9 of one run while two train: it fails as killed, the other finishes, and the third
    run, forked after the kill from the same warm process, finishes too."""
    env = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases")}
    cmd = ["--grid", "f=1,2,4", "--devices", "cpu:2", "--devices-per-run", "cpu:1", "--out", "sw",
           "--", *LONGER, "--epochs", "40"]
    sweep = sweep_popen(*cmd, cwd=tmp_path, env=env)
    folder = tmp_path / "sw"
    wait_for(lambda: all((folder / "runs" / f"f={f}" / "steps.csv").exists() for f in (1, 2)),
             "training step of both runs")
    pid = json.loads((folder / "state" / "f=1.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    out, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == 1, out
    rows = {r["name"]: r for r in summary_rows(folder)}
    assert {n: r["status"] for n, r in rows.items()} == {"f=1": "failed", "f=2": "done", "f=4": "done"}
    assert rows["f=1"]["note"].startswith("killed by SIGKILL")
    assert [r["epoch"] for r in read_metrics(folder / "runs" / "f=4")] == list(range(1, 41))
    assert WARM in (folder / "logs" / "f=4.log").read_text()


def test_kill_9_of_the_sweep_stops_its_forked_run_with_a_checkpoint(tmp_path):
    """The sweep gone (kill -9): the fork server goes with it, and the run it forked gets SIGTERM
    (PR_SET_PDEATHSIG), saves and stops."""
    env = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases")}
    cmd = ["--grid", "f=1", "--devices", "cpu:1", "--devices-per-run", "cpu:1", "--out", "sw",
           "--", *LONGER, "--epochs", "500"]
    sweep = sweep_popen(*cmd, cwd=tmp_path, env=env)
    folder = tmp_path / "sw"
    wait_for(lambda: (folder / "runs" / "f=1" / "steps.csv").exists(), "training step")
    pid = json.loads((folder / "state" / "f=1.json").read_text())["pid"]
    os.kill(sweep.pid, signal.SIGKILL)
    sweep.wait()

    def gone():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    wait_for(gone, "end of the run after its sweep died", 60)
    log = (folder / "logs" / "f=1.log").read_text()
    assert WARM in log and "stopped by SIGTERM" in log, log[-2000:]
