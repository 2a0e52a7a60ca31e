"""orphans.py: a worker sees its launcher's death from its first line, even one before it."""
import os
import re
import subprocess
import sys
import textwrap
import time

from multigpu.core.system import orphans


def test_a_worker_whose_launcher_died_before_its_first_line_exits_at_once(tmp_path):
    """The launcher (the middle process) is gone before the worker looks: a worker that took its
    parent at that moment for its launcher never noticed, and trained on alone."""
    log = tmp_path / "worker.err"
    worker = textwrap.dedent("""
        import os, sys, time
        while os.getppid() == int(sys.argv[1]):  # the launcher still lives: wait for its death
            time.sleep(0.01)
        from multigpu.core.system import orphans
        orphans.watch_from_env()
        print("went on", file=sys.stderr)
    """)
    launcher = textwrap.dedent(f"""
        import os, subprocess, sys
        env = dict(os.environ, {orphans.LAUNCHER_PID_ENV}=str(os.getpid()), RANK="1")
        subprocess.Popen([sys.executable, "-c", {worker!r}, str(os.getpid())], env=env,
                         stderr=open({str(log)!r}, "w"))
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while "exits" not in (said := log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert re.fullmatch(rf"multigpu: rank 1: the launcher \(pid {proc.pid}\) is gone before training "
                        r"began; this worker \(pid \d+\) exits \(nothing to save\)\n", said), said


def test_a_process_started_by_a_worker_is_not_watched(monkeypatch):
    """It inherits the launcher's pid, but its parent is the worker: not the launcher's worker."""
    monkeypatch.setenv(orphans.LAUNCHER_PID_ENV, str(os.getpid()))  # alive, and not our parent
    monkeypatch.setattr(orphans._State, "thread", None)
    monkeypatch.setattr(orphans._State, "launcher", None)
    assert orphans.watch_from_env() is None
    assert orphans._State.thread is None and not orphans.gone()
