"""A worker whose launcher has died stops, at any moment: watched from the worker's first line.

The launcher exports its pid (LAUNCHER_PID_ENV, launch.child_environment), and torch's agent starts
every worker as its direct child. A worker calls `watch_from_env()` before anything heavy
(`python -m multigpu ...`, multigpu.launcher.rank.worker): a launcher that died before that is seen at once
(this process is no longer its child), one that dies later within POLL_SECONDS. The pid must come
from the launcher: a worker that read its parent only once started (after importing torch, a
second or more) took init, or a subreaper, for its launcher when the launcher had died before,
and trained on alone.

Two phases:
- start-up (no handler set): nothing is worth saving, so the worker says one line and exits.
  On Linux the kernel also sends it SIGKILL when the launcher dies (PR_SET_PDEATHSIG), which ends
  it even while Python cannot run (a C call holding the GIL). That signal fires when the *thread*
  that forked the worker exits: torch's agent forks its workers in the thread that runs the
  launch (LocalElasticAgent, through subprocess.Popen), which stays there until they have ended,
  so only the launcher's death fires it.
- once `on_orphan(handler)` is called (the training loop, when its first epoch begins; a user's
  script at once): the death signal is cleared, the handler is called once (save and stop; a
  script gets SIGTERM), and a worker still alive GRACE_SECONDS later is ended with os._exit.

Torch-free and cheap: it runs before torch is imported.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

LAUNCHER_PID_ENV = "MULTIGPU_LAUNCHER_PID"
POLL_SECONDS = 0.2  # how soon a dead launcher is seen
GRACE_SECONDS = 30.0  # after the handler, the longest an orphan lives on
EXIT_ORPHAN = 1
_PR_SET_PDEATHSIG = 1


class _State:
    launcher: int | None = None
    handler: Callable[[], None] | None = None
    gone_at: float | None = None
    thread: threading.Thread | None = None
    lock = threading.Lock()


def launcher_pid(env=os.environ) -> int | None:
    """The pid the launcher exported, or None (not under multigpu's launcher, or unreadable)."""
    try:
        return int(env.get(LAUNCHER_PID_ENV, ""))
    except ValueError:
        return None


def watch_from_env() -> int | None:
    """In a worker of multigpu's launcher, watch the launcher from now on; its pid, or None when
    this process is not one of its workers (a process a worker started has another parent while
    the launcher lives: not watched). Exits at once when the launcher is already gone."""
    pid = launcher_pid()
    if pid is None or _State.thread is not None:
        return _State.launcher
    if os.getppid() != pid and alive(pid):
        return None
    _State.launcher = pid
    set_death_signal(signal.SIGKILL)
    # the launcher may have died before the line above: then no signal comes, and this sees it
    _check()
    _State.thread = threading.Thread(target=_watch, name="multigpu-orphan-watch", daemon=True)
    _State.thread.start()
    return pid


def on_orphan(handler: Callable[[], None]) -> None:
    """From now on, a dead launcher calls `handler` (once) instead of ending the worker at once;
    the worker is still ended GRACE_SECONDS later."""
    with _State.lock:
        _State.handler = handler
        if _State.launcher is not None:
            set_death_signal(0)
    _check()  # died just before: the handler now, not at the next poll


def gone() -> bool:
    """Whether this worker's launcher is known to have died."""
    return _State.gone_at is not None or (_State.launcher is not None and os.getppid() != _State.launcher)


def _watch() -> None:
    while True:
        time.sleep(POLL_SECONDS)
        _check()
        if _State.gone_at is not None and time.monotonic() - _State.gone_at > GRACE_SECONDS:
            os._exit(EXIT_ORPHAN)


def _check() -> None:
    if _State.launcher is None or os.getppid() == _State.launcher:
        return
    with _State.lock:
        if _State.gone_at is not None:
            return
        _State.gone_at = time.monotonic()
        handler = _State.handler
    who = f"rank {os.environ.get('RANK', '?')}: the launcher (pid {_State.launcher}) is gone"
    if handler is None:
        _say(f"{who} before training began; this worker (pid {os.getpid()}) exits (nothing to save)")
        os._exit(EXIT_ORPHAN)
    _say(f"{who}; stopping this worker (pid {os.getpid()})")
    handler()


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def set_death_signal(sig: int) -> None:
    """PR_SET_PDEATHSIG (Linux; elsewhere nothing): `sig` to this process when its parent thread
    exits, 0 for none."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def terminate_self() -> None:
    """The handler for a user's script: SIGTERM, which it may catch to save and stop."""
    os.kill(os.getpid(), signal.SIGTERM)


def _say(message: str) -> None:
    print(f"multigpu: {message}", file=sys.stderr, flush=True)
