"""The `multigpu` command.

Each subcommand lives in its own module with two functions:
`register(subparsers)` adds its parser, and `main(args) -> int` runs it. Beside them, what a
command checks or reads before it starts anything: strategy_checks.py and resume_checks.py for
train, sweep_settings.py for sweep.
User mistakes raise `UsageError`; they are printed here as one line (no traceback unless
`--debug`) and the exit status is 2.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import signal
import sys
import threading
import time
import traceback

from multigpu.core import startup_sigint
from multigpu.core.errors import Stopped, UsageError
from multigpu.train.rundir.provenance import PrintVersion

# name -> module under multigpu.cli; the order is the order in --help.
COMMANDS = {
    "train": "train",
    "run": "run",
    "sweep": "sweep",
    "doctor": "doctor",
    "gpus": "gpus",
    "env": "env",
    "bench": "bench",
    "plot": "plot",
    "export": "export",
    "pack": "pack",
    "test": "selftest",
}


def _parse_error(prog: str, message: str) -> str:
    """The one line for a command line argparse cannot take, naming the command it was given to."""
    where = "" if prog == "multigpu" else f"{prog}: "
    return f"multigpu: error: {where}{message}; {prog} --help lists the options"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes (a value not among the choices, a missing or malformed
    argument) are one line and exit 2, like every other bad input, not the usage block; and which
    takes no abbreviation of its options (each command's parser is one of these).
    Abbreviations: `run`, `doctor` and `sweep` take a script or a command with its own options
    after their own, and argparse checks every argument against the command's option prefixes
    first: nanoGPT's `--device=cpu` was refused as an ambiguous --devices / --device-health, a
    script's `--step 3` under doctor as --steps / --step-size. The other commands take none for
    the CLI to behave alike; a mistyped option gets its nearest (unknown_option_message)."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def error(self, message: str):
        print(_parse_error(self.prog, _with_nearest_command(message)), file=sys.stderr)
        sys.exit(2)


def _with_nearest_command(message: str) -> str:
    """argparse's "invalid choice: 'trian'" for a subcommand, with the nearest real one, as an
    unknown option gets its nearest."""
    import difflib
    import re

    typed = re.match(r"argument COMMAND: invalid choice: '([^']*)'", message)
    close = difflib.get_close_matches(typed.group(1), list(COMMANDS), n=1, cutoff=0.6) if typed else []
    return f"{message}; did you mean {close[0]}?" if close else message


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="multigpu",
        description="Train PyTorch models on one GPU, all GPUs of a machine, or several machines.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--version", action=PrintVersion, help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS.values():
        try:
            mod = importlib.import_module(f"multigpu.cli.{module}")
        except ModuleNotFoundError as exc:  # a subcommand not written yet
            if exc.name != f"multigpu.cli.{module}":
                raise
            continue
        p = mod.register(sub)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show full tracebacks on errors")
        p.set_defaults(_main=mod.main)
    return parser


def unknown_option_message(parser: argparse.ArgumentParser, command: str | None, option: str) -> str:
    """One line for an option the command does not have, with the nearest one it does have."""
    import difflib

    sub = parser
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        sub = action.choices.get(command, parser)
    name = option.split("=")[0]
    known = {o[2:]: o for o in sub._option_string_actions if o.startswith("--")}
    close = difflib.get_close_matches(name[2:], list(known), n=1, cutoff=0.7)
    prog = f"multigpu {command}" if command else "multigpu"
    hint = f"did you mean {known[close[0]]}?" if close else f"{prog} --help lists them"
    return f"multigpu: error: {prog} has no option {name}; {hint}"


def _leave_error_file(text: str) -> bool:
    """Under the launcher, what this worker failed with, for the launcher's report, which reads
    local rank 0 (its own output went to the console) only from there; whether it was written."""
    from multigpu.launcher.rank.watchdog import write_error_file

    return write_error_file(text.rstrip())


def _left_to_the_report(text: str) -> bool:
    """Under multigpu's launcher, an error that only echoes another rank's failure (a peer gone:
    "Connection closed by peer") is not printed: its traceback is in the error file, and the
    launcher's report names the rank that failed first and shows this one's if it is to blame.
    Rank 0's console otherwise shows 40 lines of it above a bad input's one-line error."""
    from multigpu.launcher.launch_failures import REPORTS_ENV, left_to_the_report

    return left_to_the_report(text, ours=os.environ.get(REPORTS_ENV) == "1")


def _mark_failed() -> None:
    """Tell a live process group not to wait for the other ranks at exit (without importing
    torch for commands that never loaded it)."""
    distributed = sys.modules.get("multigpu.core.distributed")
    if distributed is not None:
        distributed.mark_failed()


def one_line(exc: BaseException) -> str:
    """The message of a UsageError, the library's API names said as flags (flagwords); one raised
    in a DataLoader worker arrives wrapped in the worker's traceback ("Caught X in DataLoader
    worker process 0. Original Traceback ..."), whose last line is the message."""
    from multigpu.train.settings.flagwords import say

    text = say(exc)
    if "Original Traceback" not in text:
        return text
    last = text.strip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last and "Error" in last.split(": ", 1)[0] else last


def entry() -> None:
    """The `multigpu` program: main(), then the exit with its code. A Ctrl-C from then on
    (the second of two, while the process ends) would end it by the signal instead, with a
    traceback from whatever ran: the exit ignores it, the command's code is decided already.
    The process then ends as the interpreter would, but without its teardown of the modules
    (_end_now). (Not in main(): tests call it in their own process.)"""
    try:
        code = main()
    except SystemExit as exc:  # --help, argparse's errors
        if not (exc.code is None or isinstance(exc.code, int)):
            raise
        code = exc.code or 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_now(code if isinstance(code, int) and 0 <= code < 256 else 1)


def _end_now(code: int) -> None:
    """End the process with `code` as the interpreter's exit does (the threads that are not
    daemons joined, then every atexit hook, the output flushed), without its teardown of the
    modules, which nothing of multigpu's needs: with torch and its compiler imported, that took
    2-3 s of every process on the 2-core VM, after the `time:` line (benchmarks/exit_tail.py).
    A script `multigpu run` starts is not ended so: its objects may still write files as they go."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 - the interpreter's own call at exit (as sweep/starter.py)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    started = time.time()  # a job's clock (timeline.py) starts with the command
    noted: list[int] = []
    with _noting_interrupts(noted):
        try:
            return _main(list(sys.argv[1:] if argv is None else argv), started)
        except KeyboardInterrupt:  # while the parser's modules import, before a command runs
            if os.environ.get("MULTIGPU_DEBUG"):
                raise
            print("multigpu: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `multigpu sweep --dry-run ... | head`: the reader has gone
            if os.environ.get("MULTIGPU_DEBUG"):
                raise
            # what is still buffered would raise again as the interpreter flushes it at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + 13  # as a program ended by SIGPIPE, which Python turns into this error
        except BaseException:
            if not noted or os.environ.get("MULTIGPU_DEBUG"):
                raise
            # what a Ctrl-C inside an import leaves (numpy's C module half made: "cannot load
            # module more than once per process" at the next import) is the Ctrl-C's stop
            print("multigpu: interrupted", file=sys.stderr)
            return 130


@contextlib.contextmanager
def _noting_interrupts(noted: list[int]):
    """SIGINT raises KeyboardInterrupt as Python's own handler does, and is noted in `noted`
    (unless SIGINT is ignored, or handled by someone else, or this is not the main thread)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def on_sigint(signum, frame):
        noted.append(signum)
        startup_sigint.heard()  # for a launch, should the KeyboardInterrupt be dropped
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        startup_sigint.take_heard()  # this command's Ctrl-C: not a later launch's in this process


def _main(argv: list[str], started: float) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and unknown[0].startswith("--") and unknown[0] != "--":  # (a value may follow)
        command = getattr(args, "command", None)
        before = command in argv and unknown[0] in argv and argv.index(unknown[0]) < argv.index(command)
        print(unknown_option_message(parser, None if before else command, unknown[0]), file=sys.stderr)
        return 2
    if unknown:  # a stray positional (or -x): named with the command it was given to
        prog = f"multigpu {args.command}" if getattr(args, "command", None) else "multigpu"
        said = f"unexpected argument {unknown[0]!r}"
        if unknown[0] == "-m" and prog == "multigpu doctor":  # `run -m pkg` is how modules run
            module = (unknown[1:] or getattr(args, "script", None) or ["pkg.train"])[0]
            said = (f"-m {module}: a module to check goes after --, as a script does: "
                    f"multigpu doctor [--auto] -- -m {module} ARGS")
        print(_parse_error(prog, said), file=sys.stderr)
        return 2
    args.started_at = started
    if not getattr(args, "_main", None):
        parser.print_help()
        return 0
    if args.debug:  # the processes it starts show their tracebacks too
        os.environ["MULTIGPU_DEBUG"] = "1"
    try:
        code = int(args._main(args) or 0)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _mark_failed()
        raise
    except UsageError as exc:
        _mark_failed()
        if args.debug:  # the report shows the traceback, as the console does
            _leave_error_file(traceback.format_exc())
            raise
        # said first, then left for the report: a rank stopped between the two is shown twice
        # at worst, never not at all (the report takes the file's line as said on the console)
        print(f"multigpu: error: {one_line(exc)}", file=sys.stderr, flush=True)
        _leave_error_file(f"multigpu: error: {one_line(exc)}")
        return 2
    except Stopped as exc:
        print(f"multigpu: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        _mark_failed()
        print("multigpu: interrupted", file=sys.stderr)
        return 130
    except BaseException:  # an Exception, or one of torch's BaseExceptions (CheckpointException)
        text = traceback.format_exc()
        if _leave_error_file(text) and _left_to_the_report(text):
            _mark_failed()  # its peers are gone: do not wait for them at exit
            return 1
        raise
    if code:
        _mark_failed()
    return code


if __name__ == "__main__":
    sys.exit(main())
