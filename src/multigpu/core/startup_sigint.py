"""A rank's Ctrl-C while it starts up ends it at once, at any moment (issue 40, item 3).

The launcher passes a Ctrl-C on to every rank (SIGINT to each rank's process group: the ranks run
in sessions of their own). Until the training loop's stop handlers take over (train/control.py:
every rank saves and stops together), nothing of a rank is worth saving, and the
KeyboardInterrupt that Python's handler raises wherever the rank happens to be was not a reliable
stop: inside an import it ended the rank in a traceback, or left a module half made (numpy:
"cannot load module more than once per process"); while the rank waited in torch's C++ (its
process group's rendezvous with a peer that had stopped already) Python could not run the handler
at all, and the launcher killed the rank 30 s later, in a second line. A storm of Ctrl-Cs at
random moments of start-up on the loaded 2-core VM (benchmarks/ctrl_c_storm.py) met each.

So from the rank's first line (multigpu/__main__.py, a worker of multigpu train) to over(), a
SIGINT ends the process: one line on its stderr (rank 0's is the console's) and exit 130, the code
of a rank that stopped by itself (the launcher then adds nothing, and removes the untrained run
folder). It is ended by the handler where the main thread runs Python, and otherwise by a thread
that the signal wakes through the wakeup fd (signal.set_wakeup_fd: the byte is written as the
signal arrives, whatever the main thread is doing). Torch-free: it runs before any import.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading

EXIT_CODE = 128 + signal.SIGINT
MESSAGE = b"multigpu: interrupted\n"


class _State:
    handler = None  # ours, while installed
    over = False
    message = MESSAGE
    heard = False  # the launcher's: a SIGINT its handler saw, not yet acted on by a launch
    lock = threading.Lock()


def guard(say: bool = True) -> bool:
    """From now until over(), a SIGINT ends this process (see the module): in its one line, or
    silently (`say` False: a rank of `multigpu run`, whose launcher says the stop). Only in the
    main thread, and not where SIGINT is ignored (nohup, a background job); whether it is on.
    SIGINT is unblocked either way."""
    _State.message = MESSAGE if say else b""
    try:
        return _install()
    finally:  # born with SIGINT blocked (local_loop): one that came meanwhile is delivered now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _install() -> bool:
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is signal.SIG_IGN or _State.handler is not None:
        return False

    def on_sigint(signum, frame):
        if _State.over:  # put back after the training loop's handlers: Python's own behaviour
            signal.default_int_handler(signum, frame)
        _stop()

    read, write = os.pipe()
    os.set_blocking(write, False)  # the signal's byte is never waited for
    _State.handler = on_sigint
    signal.signal(signal.SIGINT, on_sigint)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read,), name="multigpu-startup-sigint", daemon=True).start()
    return True


def over() -> None:
    """The training loop's stop handlers are installed: SIGINT is theirs from now on."""
    _State.over = True


def heard() -> None:
    """In the launcher, from its SIGINT handler (cli._noting_interrupts): a Ctrl-C came. Its
    KeyboardInterrupt normally ends the command; one that Python dropped (raised inside a
    finalizer, where it is printed at most, or in a C call that clears errors) would otherwise
    let the launch start the ranks, which trained on to exit 0 (the storm saw it once)."""
    _State.heard = True


def take_heard() -> bool:
    """Whether a SIGINT was heard (heard()) and not taken yet: the launch stops on it."""
    was, _State.heard = _State.heard, False
    return was


def _watch(read: int) -> None:
    """The signals' bytes (every signal with a Python handler writes one): a SIGINT before
    over() ends the process, from here when the main thread cannot."""
    while True:
        try:
            got = os.read(read, 64)
        except OSError:
            return
        if not got:
            return
        if signal.SIGINT in got and not _State.over and \
                signal.getsignal(signal.SIGINT) is _State.handler:
            _stop()


def _stop() -> None:
    """One line and exit 130, now: nothing of a rank that has not started training is worth
    saving. os.write and os._exit: the main thread may hold the stderr object's lock, or the
    interpreter's teardown may wait for the C++ call the main thread is in."""
    with _State.lock:
        if _State.over:
            return
        with contextlib.suppress(OSError):
            if _State.message:
                os.write(2, _State.message)
        os._exit(EXIT_CODE)
