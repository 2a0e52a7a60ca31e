"""Which runs of a dead sweep still have a process (--status says "stopping", a re-run refuses)."""
import subprocess
import sys

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
