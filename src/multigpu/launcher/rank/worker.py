"""What `multigpu run` starts on every device: the watchdog, then the user's script, unchanged.

    python -P -m multigpu.launcher.rank.worker script.py ARGS...
    python -P -m multigpu.launcher.rank.worker -m pkg.mod ARGS...

The script runs as `python script.py ARGS` would run it: `__name__ == "__main__"`, `sys.argv`,
the script's folder first on sys.path (the current folder for -m), its exceptions and exit status;
a UsageError of multigpu's (a mistake the library names, with its fix) is one line and exit 2,
its traceback only with MULTIGPU_DEBUG=1 (`multigpu --debug run ...`). Under `multigpu doctor`
the script runs as a trial (trial.py): stopped after its first optimizer step(s).
`-P` keeps the current folder off sys.path while multigpu itself is imported, so a file named
multigpu.py beside the user's script (pytorch/examples has one) cannot shadow this package.
"""
from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import traceback
from collections.abc import Callable

from multigpu.core.system import orphans

orphans.watch_from_env()  # first: a launcher dead already ends this worker before any import

from multigpu.core import startup_sigint  # noqa: E402
from multigpu.launcher.rank import trial, watchdog  # noqa: E402
from multigpu.core.errors import UsageError  # noqa: E402


def main(argv: list[str], before: Callable[[], None] | None = None) -> None:
    """Run the script of `argv`; `before`: what must happen in this process before the script
    runs (multigpu.auto.worker: the process group and --auto's patches), its UsageError said in
    one line as the script's would be.
    Until the script runs, a Ctrl-C the launcher passes on ends this rank at once, silently (exit
    130; the launcher says the stop in its one line): before, one that landed while the watchdog
    imported torch ended it in a traceback of this module, and one in --auto's rendezvous waited
    in torch's C++ for the launcher's kill. The rank is born with SIGINT blocked (local_loop):
    one sent before this line waits for it. From the script's first line, SIGINT is Python's
    again (_hand_over)."""
    guarded = startup_sigint.guard(say=False)
    watchdog.start_from_env(on_orphan=orphans.terminate_self)  # the script may catch SIGTERM
    on_trial = trial.start_from_env()
    store = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))  # before the script
    ended = {"clean": False, "sigint": False}
    # At exit, after the script's own atexit handlers (last registered, first run) and after
    # Python has joined its non-daemon threads, which may still use the group.
    atexit.register(_finish_group, ended, *store)
    try:
        if before is not None:
            before()
        _hand_over(ended, guarded)
        _run_watched(argv, on_trial)
    except SystemExit as exc:
        ended["clean"] = exc.code in (None, 0)
        raise
    except UsageError as exc:  # multigpu's own one-line message for a mistake: no traceback
        if os.environ.get("MULTIGPU_DEBUG"):
            raise
        from multigpu.core.distributed import mark_failed

        mark_failed()
        print(f"multigpu: error: {exc}", file=sys.stderr, flush=True)
        watchdog.write_error_file(f"multigpu: error: {exc}")  # the report: said on the console
        sys.exit(2)
    except BaseException as exc:
        debug = bool(os.environ.get("MULTIGPU_DEBUG"))
        tb = exc.__traceback__ if debug else _from_the_script(exc)
        text = _with_the_callers(exc) if debug else "".join(
            traceback.format_exception(type(exc), exc, tb))
        if _stopped_by_sigint(exc, ended) and not debug:
            _stop_quietly(text)
        _leave_an_echo_to_the_report(text)
        # its own error: on the console (or its log) as Python prints it, and in its error file,
        # so that the report can tell another rank's same error from a new one
        watchdog.write_error_file(text.rstrip())
        if debug:  # (KeyboardInterrupt, without it, is _stop_quietly's)
            raise
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the script's own hook, if set
        sys.exit(1)  # as the uncaught exception ends `python script.py`
    ended["clean"] = True


def _hand_over(ended: dict, guarded: bool) -> None:
    """SIGINT as the script would have it under `python script.py`: Python's KeyboardInterrupt
    (noted for the stop's echo), no longer the start-up guard's exit."""
    if guarded:
        startup_sigint.over()
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _note_sigint(ended)


def _note_sigint(ended: dict) -> None:
    """Ctrl-C reaches the launcher alone (torchrun starts each rank in a session of its own),
    which passes SIGINT on to every rank and says so in one line. Noted here, so that the error a
    rank meets first (its KeyboardInterrupt, or a peer's connection closed as it stops) is known
    for the stop's echo. A script that sets its own SIGINT handler replaces this one."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def on_sigint(signum, frame):
        ended["sigint"] = True
        signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as without multigpu

    signal.signal(signal.SIGINT, on_sigint)
    ended["noted_by"] = on_sigint


def _stopped_by_sigint(exc: BaseException, ended: dict) -> bool:
    """Whether the rank's error is the stop of a SIGINT (said by the launcher in one line): one
    noted, or a KeyboardInterrupt where none could be noted (the script handles SIGINT itself).
    A KeyboardInterrupt the script raises without a signal is its own error, shown as such."""
    if ended["sigint"]:
        return True
    noting = ended.get("noted_by")
    return isinstance(exc, KeyboardInterrupt) and (
        noting is None or signal.getsignal(signal.SIGINT) is not noting)


def _stop_quietly(text: str) -> None:
    """A rank stopped by SIGINT: its traceback goes to its error file, not the console, where the
    launcher's line says what happened; exit 130, as a shell reports Ctrl-C."""
    from multigpu.core.distributed import mark_failed

    mark_failed()  # its peers are stopping too: do not wait for them at exit
    watchdog.write_error_file(text.rstrip())
    sys.exit(128 + signal.SIGINT)


def _leave_an_echo_to_the_report(text: str) -> None:
    """A script's error that only echoes another rank's failure (a peer gone in a collective)
    goes to this rank's error file, not the console: the launcher's report shows the rank that
    failed first, and this one's traceback only if it is to blame (launch_failures)."""
    from multigpu.launcher.launch_failures import REPORTS_ENV, left_to_the_report

    if left_to_the_report(text, ours=os.environ.get(REPORTS_ENV) == "1") and \
            watchdog.write_error_file(text.rstrip()):
        from multigpu.core.distributed import mark_failed

        mark_failed()  # its peers are gone: do not wait for them at exit
        sys.exit(1)  # as the exception would end it, without its traceback on the console


def _finish_group(ended: dict, addr: str | None, port: str | None) -> None:
    """A script that ends with its process group alive (most do: destroy_process_group is easy to
    forget) leaves the group to the interpreter's finalization, where gloo can abort while a peer
    is still finishing ("terminate called without an active exception"): a finished rank
    reported as failed. Torn down here instead, as multigpu's own runs do it: after a clean end
    the ranks meet, then tear down. Never an error of its own: the script has succeeded."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        from multigpu.core.distributed import destroy_distributed

        destroy_distributed(wait_for_peers=ended["clean"], store=(addr, port))
    except Exception as exc:  # noqa: BLE001 - a teardown problem must not fail a finished rank
        print(f"multigpu: note: tearing down the script's process group: {exc}", file=sys.stderr)


def _from_the_script(exc: BaseException):
    """The traceback from the script's first frame on: without this module's and runpy's frames,
    as `python script.py` shows it (all of them with --debug). A script that does not parse has
    no frame of its own (runpy's compile raised): none, as Python shows it; an error with no frame
    of the script's otherwise is ours, kept whole."""
    ours = {__file__, runpy.__file__, "<frozen runpy>"}
    tb = start = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb if tb is not None or isinstance(exc, SyntaxError) else start


def _with_the_callers(exc: BaseException) -> str:
    """--debug: every frame, main()'s callers (runpy, multigpu.auto.worker) included, as the
    interpreter prints the error that main() raises again; the launcher's report shows this text,
    and an exception's own traceback starts only where it was caught."""
    caught = traceback.TracebackException.from_exception(exc)
    callers = traceback.extract_stack(sys._getframe(2))  # 0: here, 1: main, 2: who called main
    caught.stack = traceback.StackSummary.from_list([*callers, *caught.stack])
    return "".join(caught.format())


def _run_watched(argv: list[str], on_trial) -> None:
    """The script; under a doctor's trial, its end (or error) before the trial's last step is
    written for the doctor."""
    if on_trial is None:
        return _run(argv)
    try:
        _run(argv)
    except BaseException as exc:
        on_trial.ended(exc)
        raise
    on_trial.ended(None)


def _run(argv: list[str]) -> None:
    if argv[:1] == ["-m"]:
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]  # runpy puts the module's path in argv[0]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = argv[0], argv[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
