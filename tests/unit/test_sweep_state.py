"""Which runs of a dead sweep still have a process (--status says "stopping", a re-run refuses)."""
import os
import signal
import subprocess
import sys
import time

import psutil

from multigpu.sweep.state import run_alive


def test_a_run_is_alive_while_its_process_group_is_and_not_after_its_pid_is_reused():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        began = psutil.Process(proc.pid).create_time()
        assert run_alive(proc.pid, began + 0.5)  # the state's start, just after the process began
        assert run_alive(proc.pid)
        assert not run_alive(proc.pid, began - 3600)  # began an hour after the run: its pid, reused
    finally:
        proc.kill()
        proc.wait()
    assert not run_alive(proc.pid, began)
    assert not run_alive(None) and not run_alive(-1)


def test_a_run_is_alive_while_a_process_it_started_in_a_group_of_its_own_lives():
    """As a run's loader workers are: in its session, in a process group of their own."""
    child = "import os, time; os.setpgid(0, 0); print(os.getpid(), flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                             f"subprocess.Popen([sys.executable, '-c', {child!r}])"],
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    proc.wait()  # the leader has exited; its worker lives on
    try:
        assert run_alive(proc.pid, time.time())
    finally:
        os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and run_alive(proc.pid):
        time.sleep(0.05)
    assert not run_alive(proc.pid)
