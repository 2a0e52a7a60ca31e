"""What a rank that died leaves behind is ended with it: torch's agent stops the process group of
each rank still running, but not that of a rank already dead, whose loader workers started
through a fork server hold the server alive, and it them (they watch their parent, the server)."""
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .conftest import cli_env

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float = 90) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(p.exists() and p.read_text() for p in paths):
            return [int(p.read_text()) for p in paths]
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    pytest.fail(f"not written within {timeout} s: {paths}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("auto", [[], ["--auto"]], ids=["script", "auto"])
def test_kill_9_of_a_rank_ends_its_fork_server_s_loader_workers_too(tmp_path, auto):
    """With --auto the loader workers sit in process groups of their own (loader_workers.py),
    still in the rank's session."""
    pids = tmp_path / "pids"
    pids.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "multigpu", "run", *auto, "--devices", "cpu:2",
                             "--log-dir", str(tmp_path / "logs"),
                             str(HERE / "scripts" / "forkserver_loader.py"), str(pids)],
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank1, *workers = _wait_for([pids / "rank1", pids / "rank1.worker0", pids / "rank1.worker1"], proc)
    group = [p.pid for p in psutil.process_iter() if _in_session(p.pid, rank1)]
    assert set(workers) < set(group), group  # the server, the workers, the resource tracker
    os.kill(rank1, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=120)
        assert f"rank 1 failed first (signal SIGKILL, local rank 1, pid {rank1})" in err, err[-3000:]
        left = [pid for pid in group if _alive(pid)]
        assert left == [], [psutil.Process(p).cmdline() for p in left if _alive(p)]
    finally:
        _end(group, rank1)  # where the test fails: they would hold each other alive for good


def _end(pids: list[int], pgid: int) -> None:
    for pid in pids:
        if _alive(pid) and _in_group(pid, pgid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _in_group(pid: int, group: int) -> bool:
    try:
        return os.getpgid(pid) == group
    except OSError:
        return False


def _in_session(pid: int, session: int) -> bool:
    try:
        return os.getsid(pid) == session
    except OSError:
        return False


@pytest.mark.extended  # make test stays under 15 minutes; CI runs it
def test_with_max_restarts_the_dead_rank_s_leftovers_end_before_the_next_attempt_runs(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "multigpu", "run", "--devices", "cpu:2",
                             "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"),
                             str(HERE / "scripts" / "forkserver_loader.py"), str(pids)],
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    group, rank1 = [], 0
    try:
        rank1, *_ = _wait_for([pids / "rank1", pids / "rank1.worker0", pids / "rank1.worker1"], proc)
        group = [p.pid for p in psutil.process_iter() if _in_group(p.pid, rank1)]
        for name in ("rank1", "rank1.worker0", "rank1.worker1"):
            (pids / name).unlink()
        os.kill(rank1, signal.SIGKILL)
        again, *_ = _wait_for([pids / "rank1", pids / "rank1.worker0", pids / "rank1.worker1"], proc)
        assert again != rank1 and proc.poll() is None
        assert [pid for pid in group if _alive(pid)] == []
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        _end(group, rank1)
    assert "rank 1 (pid " in err, err[-3000:]
    assert "was killed by SIGKILL; restarting all workers (restart 1 of 1)" in err, err[-3000:]
