"""After a failure its ranks could not say themselves, the launcher of `multigpu train` says how to
go on: kill -9 of a worker, a second Ctrl-C while the ranks are stuck, each with a complete
checkpoint on disk, end with the command that resumes from it; and with --max-restarts a restart
says which rank died and how. Each fault is caused for real (2 CPU processes, gloo)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from multigpu.train.checkpoints.checkpoint_store import CheckpointStore

from .conftest import cli_env, suspend

pytestmark = pytest.mark.slow

ARGS = ["train", "--model", "mlp", "--data", "synthetic:20000", "--batch-size", "16",
        "--workers", "0", "--checkpoint-every", "20", "--logger", "none", "--devices", "cpu:2"]


def start(tmp_path: Path, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "multigpu", *ARGS, "--out", "run", *extra],
                            cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def after_the_first_checkpoint(tmp_path: Path, launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the workers, once the run's first checkpoint is complete."""
    deadline = time.monotonic() + 120
    manifest = tmp_path / "run" / "checkpoints" / "manifest.json"
    while not manifest.exists():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.1)
    return {int(p.environ()["RANK"]): p.pid for p in psutil.Process(launcher.pid).children()}


def stop_pending(pid: int) -> bool:
    """Whether a SIGINT or SIGTERM waits for the (suspended) process `pid` (Linux:
    /proc/PID/status): the launcher has handled the first Ctrl-C and passed a stop on."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":\t" in line)
    bit = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
    return any(int(fields.get(k, "0"), 16) & bit for k in ("ShdPnd", "SigPnd"))


def resume_line(tmp_path: Path, epochs: str) -> str:
    newest = CheckpointStore(tmp_path / "run" / "checkpoints").entries()[-1].file
    return (f"multigpu: checkpoint run/checkpoints/{newest} is complete; to go on from it, run: "
            f"multigpu train {' '.join(ARGS[1:])} --out run --epochs {epochs} --resume run")


@pytest.mark.smoke
def test_kill_9_of_a_worker_ends_with_the_command_that_resumes(tmp_path):
    launcher = start(tmp_path, "--epochs", "3")
    try:
        workers = after_the_first_checkpoint(tmp_path, launcher)
        psutil.Process(workers[1]).kill()
        _, err = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGKILL, err
    assert f"rank 1 failed first (signal SIGKILL, local rank 1, pid {workers[1]})" in err
    assert ("multigpu: SIGKILL ended it, so it left no traceback (kill -9, or the kernel's "
            "out-of-memory killer: `dmesg` says which)") in err, err
    assert err.splitlines()[-1] == resume_line(tmp_path, "3"), err
    assert err.count("--resume") == 1
    # what a rank stopped by the agent's SIGTERM reads to say why (train/control.py)
    reasons = list((tmp_path / "run" / "logs").glob("*/attempt_0/STOPPING"))
    assert [p.read_text() for p in reasons] == ["local rank 1 was killed by SIGKILL\n"], reasons


def test_a_second_ctrl_c_ends_with_the_command_that_resumes(tmp_path):
    launcher = start(tmp_path, "--epochs", "3")
    try:
        workers = after_the_first_checkpoint(tmp_path, launcher)
        for pid in workers.values():  # stuck ranks: only a second Ctrl-C ends them
            suspend(psutil.Process(pid))
        launcher.send_signal(signal.SIGINT)  # asks for a stop: the launcher passes it on
        deadline = time.monotonic() + 60
        while not any(stop_pending(pid) for pid in workers.values()):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)  # the second: stop at once
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGINT, err
    lines = err.splitlines()
    assert lines[-2] == ("multigpu: stopped by SIGINT; every rank of this node was stopped "
                         "(a second signal: killed at once)"), err
    assert lines[-1] == resume_line(tmp_path, "3"), err
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in workers.values())


def test_a_restart_says_which_rank_died_and_how(tmp_path):
    launcher = start(tmp_path, "--epochs", "1", "--max-restarts", "1")
    try:
        workers = after_the_first_checkpoint(tmp_path, launcher)
        psutil.Process(workers[1]).kill()
        _, err = launcher.communicate(timeout=240)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err
    said = [line for line in err.splitlines() if "restarting all workers" in line]
    assert said == [f"multigpu: warning: rank 1 (pid {workers[1]}) was killed by SIGKILL; "
                    "restarting all workers (restart 1 of 1)"], err
    assert "--resume" not in err  # it went on by itself


def sigterm_to_rank_1(tmp_path: Path, *extra) -> str:
    """What the launcher said (stderr) when rank 1 alone got SIGTERM after the first checkpoint;
    its exit code checked (the stop's)."""
    launcher = start(tmp_path, "--epochs", "3", *extra)
    try:
        workers = after_the_first_checkpoint(tmp_path, launcher)
        os.kill(workers[1], signal.SIGTERM)
        _, err = launcher.communicate(timeout=180)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, err
    return err


def test_a_stop_signal_sent_to_one_rank_stops_every_rank_as_a_stop_not_a_failure(tmp_path):
    """`kill PID` of rank 1: the ranks stop together and save, and rank 0 says where and how to go
    on; the launcher reports no failure, and writes no reason for an agent's stop."""
    err = sigterm_to_rank_1(tmp_path)
    newest = CheckpointStore(tmp_path / "run" / "checkpoints").entries()[-1].file
    last = err.splitlines()[-1]
    assert last.startswith("multigpu: stopped by SIGTERM ") and last.endswith(
        f"checkpoint run/checkpoints/{newest} is complete; run the same command with --resume run "
        "to go on"), err
    assert "failed" not in err and err.count("--resume") == 1, err
    assert not list((tmp_path / "run" / "logs").glob("*/attempt_0/STOPPING"))


@pytest.mark.extended  # about 9 s on 2 cores: CI runs it (make test-all)
def test_a_stop_signal_sent_to_one_rank_stops_with_max_restarts_too(tmp_path):
    """`kill PID` of rank 1 under --max-restarts: the ranks stop together and save, as without
    it; the agent does not take their stop for a failure and start them again."""
    err = sigterm_to_rank_1(tmp_path, "--max-restarts", "1")
    assert "restarting all workers" not in err and "failed" not in err, err
    assert not list((tmp_path / "run" / "logs").glob("*/attempt_1")), err
    last = err.splitlines()[-1]
    assert last.startswith("multigpu: stopped by SIGTERM ") and last.endswith(
        "run the same command with --resume run to go on"), err

