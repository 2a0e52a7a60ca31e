"""Small runs packed: K runs on one leased device, runs forked from the sweep's warm process with
the same results as runs alone, and a run killed there leaving the others (and the next runs)
unharmed. Real `multigpu sweep` and `multigpu train` processes on CPU."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from multigpu.launcher import leases

from .conftest import cli_env, multigpu, read_metrics, suspend
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


def session(sid: int) -> list[int]:
    """The live processes of the session `sid` (a run's: it calls setsid), its leader first."""
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return sorted(found, key=lambda q: q != sid)


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
    assert ("] --runs-per-gpu 2 on CPU cores: 2 runs take turns on each core, so training gains "
            "nothing and each run takes about 2x as long; it helps only runs that mostly wait (on "
            "files, the network). For 1 run a core, leave --runs-per-gpu out\n") in out
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


@pytest.mark.extended  # 10-20 s on 2 cores: CI runs it (make test-all)
def test_a_forked_run_killed_leaves_the_others_and_the_next_ones_finishing(tmp_path):
    """kill -9 of one run while two train: it fails as killed, what it started (its loader
    workers) ends too, the other finishes, and the third run, forked after the kill from the same
    warm process, finishes too."""
    env = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases")}
    cmd = ["--grid", "f=1,2,4", "--devices", "cpu:2", "--devices-per-run", "cpu:1", "--out", "sw",
           "--", *LONGER, "--epochs", "40", "--workers", "1"]
    sweep = sweep_popen(*cmd, cwd=tmp_path, env=env)
    folder = tmp_path / "sw"
    wait_for(lambda: all((folder / "runs" / f"f={f}" / "steps.csv").exists() for f in (1, 2)),
             "training step of both runs")
    pid = json.loads((folder / "state" / "f=1.json").read_text())["pid"]
    wait_for(lambda: session(pid)[1:], "loader worker of the run")  # what must not outlive it
    os.kill(pid, signal.SIGKILL)
    try:
        wait_for(lambda: not session(pid), "end of the killed run's loader workers", 30)
    finally:
        for left in session(pid):  # left behind by a failure
            os.kill(left, signal.SIGKILL)
    out, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == 1, out
    rows = {r["name"]: r for r in summary_rows(folder)}
    assert {n: r["status"] for n, r in rows.items()} == {"f=1": "failed", "f=2": "done", "f=4": "done"}
    assert rows["f=1"]["note"].startswith("killed by SIGKILL")
    assert [r["epoch"] for r in read_metrics(folder / "runs" / "f=4")] == list(range(1, 41))
    assert WARM in (folder / "logs" / "f=4.log").read_text()


# Imported by every Python the test starts; in the sweep's fork server alone (the one that
# preloads multigpu's CLI), an exit handler that takes 30 s: the shutdown of an interpreter that
# preloaded torch, as slow as a loaded machine makes it (the runs must not wait for that).
SLOW_SERVER_EXIT = textwrap.dedent("""
    import atexit, os, time
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read()
    if b"multiprocessing.forkserver" in cmdline and b"multigpu.cli.train" in cmdline:
        server = os.getpid()
        atexit.register(lambda: os.getpid() == server and time.sleep(30))
""")


def pending_signals(pid: int) -> int:
    """The signals sent to `pid` and not yet handled (a stopped process keeps them pending)."""
    fields = dict(ln.split(":\t", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)


def test_kill_9_of_the_sweep_stops_its_forked_runs_at_once_and_status_says_stopping(tmp_path):
    """A run forked from the sweep's warm process gets SIGTERM as soon as the sweep is killed with
    -9 (its fork server's slow exit does not hold it up); while it lives, --status says it is
    stopping, with its pid, and the same command refuses to start; then it ends with a checkpoint.
    The run is held with SIGSTOP meanwhile, so that the SIGTERM stays pending where it can be seen."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_SERVER_EXIT)
    cmd = ["--grid", "seed=1", "--devices", "cpu:1", "--devices-per-run", "cpu:1", "--out", "sw",
           "--", "multigpu", "train", "--model", "mlp", "--data", "synthetic:40000", "--epochs", "3",
           "--batch-size", "16", "--checkpoint-every", "0", "--logger", "csv", "--log-every", "10"]
    env = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases"),
           "PYTHONPATH": f"{site}{os.pathsep}{cli_env()['PYTHONPATH']}"}
    sweep = sweep_popen(*cmd, cwd=tmp_path, env=env)
    folder = tmp_path / "sw"
    wait_for(lambda: (folder / "runs" / "seed=1" / "steps.csv").exists(), "training step", 180)
    state = json.loads((folder / "state" / "seed=1.json").read_text())
    assert state["status"] == "running" and state["pid"], state
    pid = state["pid"]
    run = psutil.Process(pid)
    server = psutil.Process(run.ppid())
    assert WARM in (folder / "logs" / "seed=1.log").read_text()
    os.kill(pid, signal.SIGSTOP)
    try:
        os.kill(sweep.pid, signal.SIGKILL)
        sweep.wait()
        killed = time.monotonic()
        while time.monotonic() - killed < 2 and not pending_signals(pid) & (1 << (signal.SIGTERM - 1)):
            time.sleep(0.01)
        assert pending_signals(pid) & (1 << (signal.SIGTERM - 1)), "no SIGTERM 2 s after the sweep died"

        status = subprocess.run([sys.executable, "-m", "multigpu", "sweep", "--status", "sw"],
                                cwd=tmp_path, env={**cli_env(), **env}, capture_output=True, text=True,
                                timeout=120)
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        head, row = lines[0], next(ln for ln in lines if ln.startswith("seed=1 "))
        assert head == (f"sweep sw: 1 runs: 1 stopping; not running, but 1 run of it is still "
                        f"stopping (pid {pid}): wait for it before running the same command again")
        assert row.split()[:2] == ["seed=1", "stopping"], status.stdout
        assert row.endswith(f"pid {pid} is stopping (its sweep is gone)"), status.stdout

        again = subprocess.run([sys.executable, "-m", "multigpu", "sweep", *cmd], cwd=tmp_path,
                               env={**cli_env(), **env}, capture_output=True, text=True, timeout=120)
        assert again.returncode == 2 and again.stdout == "", again.stdout + again.stderr
        assert again.stderr == (f"multigpu: error: run seed=1 of an earlier sweep is still stopping "
                                f"(session {pid}); wait for it, or end it with: pkill -KILL -s {pid}\n")
        os.kill(pid, signal.SIGCONT)
        run.wait(timeout=60)
        wait_for(lambda: not session(pid), "end of what the run started (its loader workers)", 30)
    finally:  # nothing left behind when an assertion failed
        for p in (run, server):
            try:
                p.kill()
            except psutil.Error:
                pass
    assert "stopped by SIGTERM" in (folder / "logs" / "seed=1.log").read_text()
    after = multigpu("sweep", "--status", "sw", cwd=tmp_path)
    row = next(ln for ln in after.stdout.splitlines() if ln.startswith("seed=1 "))
    assert row.split()[:2] == ["seed=1", "stopped"], after.stdout


@pytest.mark.extended  # 10-20 s on 2 cores: CI runs it (make test-all)
def test_ranks_of_a_two_process_run_left_by_a_dead_sweep_are_stopping_while_they_hold_its_folder(tmp_path):
    """torch's agent starts each rank in a session of its own: once the sweep and the run's
    launcher are gone, the ranks (still saving) are outside the run's session, and only the run
    folder they hold says that the run is not over. Held with SIGSTOP here, as a slow save would."""
    cmd = ["--grid", "seed=1", "--devices", "cpu:2", "--devices-per-run", "cpu:2", "--out", "sw",
           "--", "multigpu", "train", "--model", "mlp", "--data", "synthetic:40000", "--epochs", "3",
           "--batch-size", "16", "--checkpoint-every", "0", "--logger", "csv", "--log-every", "10"]
    env = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases")}
    sweep = sweep_popen(*cmd, cwd=tmp_path, env=env)
    folder = tmp_path / "sw"
    wait_for(lambda: (folder / "runs" / "seed=1" / "steps.csv").exists(), "training step", 180)
    launcher = json.loads((folder / "state" / "seed=1.json").read_text())["pid"]
    ranks = [p for p in psutil.Process(launcher).children(recursive=True)
             if os.getsid(p.pid) == p.pid]  # the ranks: sessions of their own
    assert len(ranks) == 2, ranks
    try:
        for rank in ranks:
            suspend(rank)
        os.kill(sweep.pid, signal.SIGKILL)
        sweep.wait()
        os.killpg(launcher, signal.SIGKILL)  # the launcher's session: all that is left is the ranks
        wait_for(lambda: not session(launcher), "end of the launcher's session", 30)
        status = multigpu("sweep", "--status", "sw", cwd=tmp_path)
        row = next(ln for ln in status.stdout.splitlines() if ln.startswith("seed=1 "))
        assert row.split()[:2] == ["seed=1", "stopping"], status.stdout
    finally:
        for rank in ranks:
            try:
                rank.resume()
            except psutil.Error:
                pass
    for rank in ranks:  # orphaned, they stop by themselves (orphans.GRACE_SECONDS)
        rank.wait(timeout=120)
    after = multigpu("sweep", "--status", "sw", cwd=tmp_path)
    row = next(ln for ln in after.stdout.splitlines() if ln.startswith("seed=1 "))
    assert row.split()[:2] == ["seed=1", "stopped"], after.stdout
