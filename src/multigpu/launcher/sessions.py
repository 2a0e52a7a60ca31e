"""The ranks' processes as the launcher ends them (local_loop): the waits after a stop signal,
what is left of a rank's session. Torch-free.

Each rank runs in a session of its own (its pid names the session and its process group), so a
Ctrl-C in the terminal reaches the launcher only, which passes it on.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

AGENT_STOP_WAIT = 30  # torch's agent: seconds it waits for the workers after a stop signal
# (LaunchConfig.shutdown_timeout where torch has it: TORCH_ELASTIC_SHUTDOWN_TIMEOUT)
RANKS_STOP_WAIT = 10.0  # s the others are given once a rank stopped by itself on a signal


def stop_wait() -> int:
    """Seconds the ranks get to end after a stop signal before they are killed: torch's agent's
    shutdown timeout, which TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets (30 s by default)."""
    try:
        return max(0, int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", AGENT_STOP_WAIT)))
    except ValueError:
        return AGENT_STOP_WAIT


def let_the_others_end(procs, wait: float) -> None:
    """Ranks that stop together on a stop signal sent to one of them (`kill PID` of a rank of
    multigpu train: every rank saves, then exits 128 + N) end one after another: the attempt
    is closed as soon as the first has ended, and its SIGTERM would reach a rank still exiting
    (its logger closing) and end it by the signal, a stop then said as a failure. The others
    (subprocess.Popen objects) get `wait` seconds to end by themselves first."""
    deadline = time.monotonic() + wait
    for p in procs:
        with contextlib.suppress(Exception):  # subprocess.TimeoutExpired: the SIGTERM then
            p.wait(max(deadline - time.monotonic(), 0))


def end_session_left(sid: int) -> None:
    """SIGKILL to what is left of the session of a rank that has ended (its pid names the session
    and its process group): the group, and the groups its loader workers moved to. Nothing if a
    process with that pid lives: the rank's pid given to another process, which may lead a
    session of its own."""
    import psutil

    try:
        os.kill(sid, 0)
        return
    except ProcessLookupError:
        pass
    except PermissionError:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sid, signal.SIGKILL)  # first the fork server, which could start more
    killed = []
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to see
            if os.getsid(proc.pid) == sid:
                os.kill(proc.pid, signal.SIGKILL)
                killed.append(proc)
    _until_gone(killed, LEFTOVERS_WAIT)


LEFTOVERS_WAIT = 5.0  # s a killed leftover is given to be gone (a zombie counts as gone)


def _until_gone(procs, wait: float) -> None:
    """Until every process of `procs` has ended (or `wait` s): a SIGKILLed process takes a moment
    to die, and a launcher that ended at once left it running behind it (the leftovers test, on
    the loaded VM, once the launcher's own exit took no time)."""
    import psutil

    deadline = time.monotonic() + wait
    while procs and time.monotonic() < deadline:
        procs = [p for p in procs if _running(p, psutil)]
        if procs:
            time.sleep(0.02)


def _running(proc, psutil) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_workers_left() -> int:
    """SIGKILL to the workers still alive, with their children (they run in sessions of their
    own, so a Ctrl-C in the terminal does not reach them)."""
    import psutil

    left = [p for p in psutil.Process().children() if p.is_running()]
    for p in left:
        with contextlib.suppress(psutil.Error):
            for q in [*p.children(recursive=True), p]:
                q.kill()
    return len(left)
