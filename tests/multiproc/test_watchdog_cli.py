"""The watchdog and the launcher's side of stopping, for real: `multigpu run` on CPU processes.

Hangs are caused (a rank skips an all-reduce, a script sets WORLD_SIZE itself), launchers are
killed with -9 and sent SIGUSR1 and SIGTERM twice; the assertions are on what the user sees.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .test_run_cli import SCRIPTS, clean_env, multigpu, start

pytestmark = pytest.mark.slow


@pytest.mark.extended  # about 12 s on 2 cores: CI runs it (make test-all)
def test_a_rank_that_skips_an_all_reduce_is_named_with_where_it_waits(tmp_path):
    began = time.monotonic()
    r = multigpu("--devices", "cpu:2", "--hang-timeout", "8", "--log-dir", str(tmp_path / "logs"),
                 str(SCRIPTS / "skip_allreduce.py"), cwd=tmp_path, timeout=120)
    assert r.returncode == 124, r.stderr
    assert time.monotonic() - began < 8 + 25, "within about the timeout (plus start-up)"
    err = r.stderr
    assert "multigpu: hang: no rank made progress for 8 s (--hang-timeout 8)" in err
    assert "rank 0: stuck" in err and "in all_reduce (torch) called from skip_allreduce.py:18" in err
    assert "rank 1: stuck" in err and "skip_allreduce.py:9 in after_skipping" in err
    assert "Traceback" not in err
    for rank in (0, 1):  # every rank's stack, all threads, beside the logs
        stack = (tmp_path / "logs" / f"hang-rank{rank}.txt").read_text()
        assert "skip_allreduce.py" in stack and "Thread" in stack


@pytest.mark.extended
def test_a_script_that_sets_world_size_is_told_instead_of_waiting_in_silence(tmp_path):
    r = multigpu("--devices", "cpu:2", "--hang-timeout", "6", "--log-dir", str(tmp_path / "logs"),
                 str(SCRIPTS / "own_world_size.py"), cwd=tmp_path, timeout=120)
    assert r.returncode == 124, r.stderr
    assert "rank 0: the script set WORLD_SIZE=3 (multigpu had set 2)" in r.stderr
    assert "rank 1: its script set WORLD_SIZE=3; multigpu had set 2: leave WORLD_SIZE to the launcher" in r.stderr


@pytest.mark.extended
def test_one_slow_rank_is_not_a_hang(tmp_path):
    r = multigpu("--devices", "cpu:2", "--hang-timeout", "3", "--log-dir", str(tmp_path / "logs"),
                 str(SCRIPTS / "slow_rank0.py"), "9", cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "done 0" in r.stdout and "hang" not in r.stderr


def _worker_pids(out: Path, proc, n=2) -> list[int]:
    deadline = time.monotonic() + 60
    while len(list(out.glob("pid*"))) < n:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    return [int(p.read_text()) for p in out.glob("pid*")]


def _gone_within(pids, seconds) -> bool:
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=seconds)
    return not alive


@pytest.mark.smoke
def test_workers_whose_launcher_was_killed_stop_within_seconds(tmp_path, procs):
    p = start("--devices", "cpu:2", str(SCRIPTS / "sleeper.py"), str(tmp_path), cwd=tmp_path)
    procs.append(p)
    pids = _worker_pids(tmp_path, p)
    p.kill()
    p.wait()
    assert _gone_within(pids, 10), "orphaned workers went on"


def test_sigusr1_reaches_every_worker(tmp_path, procs):
    p = start("--devices", "cpu:2", str(SCRIPTS / "on_signal.py"), str(tmp_path), cwd=tmp_path)
    procs.append(p)
    _worker_pids(tmp_path, p)
    p.send_signal(signal.SIGUSR1)
    _, err = p.communicate(timeout=60)
    assert sorted(f.name for f in tmp_path.glob("usr1-*")) == ["usr1-0", "usr1-1"]
    assert "stopped by SIGUSR1" in err


def test_a_second_sigterm_ends_workers_that_ignore_the_first_at_once(tmp_path, procs):
    p = start("--devices", "cpu:2", str(SCRIPTS / "on_signal.py"), str(tmp_path), "ignore", cwd=tmp_path)
    procs.append(p)
    pids = _worker_pids(tmp_path, p)
    p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20  # within the agent's 30 s wait, after which it kills them
    while len(list(tmp_path.glob("term-*"))) < 2:  # the launcher passed it on to every rank
        assert p.poll() is None and time.monotonic() < deadline, \
            sorted(f.name for f in tmp_path.glob("term-*"))
        time.sleep(0.1)
    assert all(psutil.pid_exists(pid) for pid in pids), "the first SIGTERM is ignored by the script"
    began = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert time.monotonic() - began < 10, "not the agent's 30 s grace"
    assert _gone_within(pids, 5)
    assert "stopped by SIGTERM" in err and "killed at once" in err


def test_a_file_named_multigpu_py_beside_the_script_does_not_shadow_us(tmp_path):
    (tmp_path / "multigpu.py").write_text("raise SystemExit('the user file was imported')\n")
    (tmp_path / "train.py").write_text("import os\nprint('rank', os.environ['RANK'])\n")
    # As the `multigpu` command starts (python -P: its own folder, not the current one, on the path)
    r = subprocess.run([sys.executable, "-P", "-m", "multigpu", "run", "--devices", "cpu:2", "train.py"],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "rank 0" in r.stdout


def test_the_rendezvous_listens_on_loopback_only(tmp_path, procs):
    p = start("--devices", "cpu:2", str(SCRIPTS / "sleeper.py"), str(tmp_path), cwd=tmp_path)
    procs.append(p)
    _worker_pids(tmp_path, p)
    listening = [c.laddr for c in psutil.Process(p.pid).net_connections() if c.status == "LISTEN"]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
    env = {k: v for k, v in (psutil.Process(int((tmp_path / "pid0").read_text())).environ()).items()
           if k.startswith("MASTER_")}
    assert env["MASTER_ADDR"] == "127.0.0.1"
    os.kill(p.pid, signal.SIGTERM)


def test_ranks_that_outlast_the_agents_wait_are_said_to_be_killed(tmp_path, procs):
    """A stop signal the ranks do not end on (a save longer than the agent's wait): the agent kills
    them when its wait runs out (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default), and the line
    says so, so that nobody takes the ranks for stopped after a checkpoint."""
    p = start("--devices", "cpu:2", str(SCRIPTS / "on_signal.py"), str(tmp_path), "ignore", cwd=tmp_path,
              TORCH_ELASTIC_SHUTDOWN_TIMEOUT="3")
    procs.append(p)
    pids = _worker_pids(tmp_path, p)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert _gone_within(pids, 5)
    assert "multigpu: stopped by SIGTERM; every rank of this node was stopped (killed: they had not " \
           "stopped 3 s after the signal)" in err, err
