"""What the launcher says when a launch fails: which rank failed first and why, a hang's summary,
a rendezvous that did not complete. Pure text from torchrun's failure objects and the logs."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from collections.abc import Callable

from multigpu.launcher import ports
from multigpu.launcher.rank import watchdog
from multigpu.launcher.ports import Rendezvous, parse_nnodes
from multigpu.launcher.rank.stop_reason import how_it_ended

if TYPE_CHECKING:
    from multigpu.launcher.launch_options import LaunchOptions


def err(msg: str) -> None:
    print(f"multigpu: {msg}", file=sys.stderr, flush=True)


def _checks(opts: LaunchOptions, rdzv: Rendezvous) -> str:
    slurm = (" Under SLURM start it with srun --ntasks-per-node=1."
             if "SLURM_JOB_ID" in os.environ else "")
    return (f"Check that every node runs the same command with --nnodes {opts.nnodes} and the same "
            f"rendezvous {rdzv.endpoint}, that this address and port are reachable from every node "
            f"(firewall), and that each node has its own --node-rank 0..N-1.{slurm}")


def rendezvous_timeout_message(opts: LaunchOptions, rdzv: Rendezvous, joined: list[str]) -> str:
    lo, _ = parse_nnodes(opts.nnodes)
    seen = (f"{len(joined)} of {lo} nodes joined ({', '.join(n.rsplit('_', 2)[0] for n in joined)})"
            if joined else f"fewer than {lo} nodes joined")
    return (f"the rendezvous at {rdzv.endpoint} did not complete within --start-timeout "
            f"{opts.start_timeout:g} s: {seen}, expected {opts.nnodes}. {_checks(opts, rdzv)}")


def rendezvous_failed_message(exc: BaseException, opts: LaunchOptions, rdzv: Rendezvous) -> str:
    inner = exc.__cause__ or exc  # torchrun wraps the store's error; its first line says it
    cause = (str(inner).strip().splitlines() or [type(inner).__name__])[0].rstrip(".")
    port = rdzv.endpoint.rsplit(":", 1)[-1]
    full = str(inner)
    if "address already in use" in full.lower() or "EADDRINUSE" in full:
        holder = ports.port_holder(int(port)) if port.isdigit() else None
        return (f"port {port} of the rendezvous {rdzv.endpoint} is already in use"
                f"{f' (held by {holder})' if holder else ''}; name another port with "
                "--master-port, or leave it out on a single machine")
    return (f"could not reach the rendezvous at {rdzv.endpoint} ({cause}). "
            f"Node 0 must be started and listening there. {_checks(opts, rdzv)}")


_COLLATERAL = re.compile(r"gloo|nccl|DistBackendError|DistNetworkError|Connection (reset|closed)|"
                         r"Broken pipe|ProcessGroup|timed out|SIGTERM", re.IGNORECASE)
# Set by the launcher in its workers' environment: it reports their failures, so a multigpu worker
# whose error only echoes another rank's (is_echo) leaves its traceback to the error file and to
# the report, instead of printing it above the report (cli.main).
REPORTS_ENV = "MULTIGPU_LAUNCHER_REPORTS"


def is_echo(text: str | None) -> bool:
    """Whether an error's text ends on a communication error: most often the echo of a failure
    on another rank (a peer gone, a collective that timed out)."""
    lines = (text or "").strip().splitlines()
    return bool(lines and _COLLATERAL.search(lines[-1]))


def left_to_the_report(text: str | None, ours: bool) -> bool:
    """Whether a worker's error stays off its console, for the report to show: an echo (is_echo)
    in one of multigpu's own workers (`ours`: REPORTS_ENV in the worker, `on_usage_error` given
    in the launcher), unless --debug (MULTIGPU_DEBUG, set in both) wants every traceback."""
    return ours and not os.environ.get("MULTIGPU_DEBUG") and is_echo(text)


def restart_note(env=os.environ) -> str | None:
    """What rank 0 of a restarted `multigpu train` (--max-restarts) says first: which restart this
    is, what the failed attempt's first error of its own was, and where that attempt's output is.
    The full report comes only when no restart is left, and a worker's echo of another rank's
    failure stays off the console (REPORTS_ENV)."""
    try:
        count = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if count <= 0:
            return None
        note = (f"restart {count} of {env.get('TORCHELASTIC_MAX_RESTARTS', '?')} (--max-restarts): "
                "the previous attempt failed")
        # <run dir>/attempt_<n>/<local rank>/error.json: this node's folder of the attempt before
        here = env.get("TORCHELASTIC_ERROR_FILE")
        folder = Path(here).parents[1].with_name(f"attempt_{count - 1}") if here else None
        if folder is None or not folder.is_dir():
            return note
        cause = _first_error(folder)
        return (note + (f" ({cause})" if cause else "")
                + f"; the output and errors of this node's ranks in it: {folder}")
    except (OSError, ValueError, IndexError):  # a note must never stop the training
        return None


def say_next_step(next_step: Callable[[], str | None] | None) -> None:
    """The launch's `next_step` line, if it has one (launch.launch)."""
    line = next_step() if next_step is not None else None
    if line:
        err(line)


def restart_line(failures: dict, restart: int, total: int, on: str = "") -> str:
    """'rank R (pid N) was killed by SIGKILL; restarting all workers (restart 1 of 2)', for the
    rank that failed first of its own (not stopped by the agent's SIGTERM) and, before the times,
    not with an echo of it (is_echo): a peer that lost it in a collective often ends first, and
    the times are whole seconds (a rank without an error file: when the agent saw it end).
    `on`: where the restart runs instead, when not on the same devices (lost_devices)."""
    own = [(r, f) for r, f in failures.items()
           if f.exitcode != -signal.SIGTERM or _stopped_after_its_error(f)] or list(failures.items())
    rank, first = min(own, key=lambda item: (
        is_echo(error_text(getattr(item[1], "error_file_data", None) or {})), getattr(item[1], "timestamp", 0)))
    how = "raised an error" if _stopped_after_its_error(first) else how_it_ended(first.exitcode)
    where = on or "restarting all workers"
    return f"rank {rank} (pid {first.pid}) {how}; {where} (restart {restart} of {total})"


def _first_error(attempt: Path) -> str | None:
    """'local rank K: <its error's last line>' for the first rank of an attempt folder whose error
    file holds an error of its own (not an echo), by the files' times; None without one."""
    found = []
    for path in attempt.glob("*/error.json"):
        try:
            text = error_text(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
        if text and text.strip() and not is_echo(text):
            found.append((path.stat().st_mtime, path.parent.name, text.strip().splitlines()[-1]))
    if not found:
        return None
    _, rank, line = min(found)
    return f"local rank {rank}: {line[:200]}"


def error_text(data: dict) -> str | None:
    """The error in a torchelastic error file's data: multigpu's plain message, or @record's
    traceback; None for none ("<NONE>": torchrun's placeholder)."""
    msg = data.get("message")
    if isinstance(msg, dict):
        return str((msg.get("extraInfo") or {}).get("py_callstack") or msg.get("message") or "")
    if isinstance(msg, str) and msg and msg != "<NONE>":
        return msg
    return None


def report_child_failed(exc, log_dir: str, node: str | None = None,
                        on_usage_error: Callable[[], None] | None = None, since: float | None = None,
                        ours: bool | None = None) -> int:
    """Print which rank failed first and its traceback; return the exit code to use. The ranks
    are global ranks; `node` names this node in a launch of several ('node 1 (host)'); `since`:
    when the launch began (time.time()), to tell its logs from earlier launches'. When the
    failure is bad input said in one line (see _usage_error), only that line is printed and
    `on_usage_error` is called: the logs then hold nothing more than that line. Pass it only for
    workers that are multigpu's own commands (exit 2: they said a `multigpu: error:` line).
    `ours`: the workers leave an echo of another rank's failure to this report (REPORTS_ENV);
    by default, where `on_usage_error` is given."""
    ours = on_usage_error is not None if ours is None else ours
    failures = list(exc.failures.items())  # in the order the agent saw them fail
    launch = _launch_folders(log_dir, [f for _, f in failures], since)
    texts = {rank: _failure_text(f, launch) for rank, f in failures}
    hang = next((texts[r] for r, f in failures if f.exitcode == watchdog.EXIT_HANG and texts[r]
                 and texts[r].startswith(watchdog.HANG_HEADER)), None)
    if hang is not None:
        err("\nmultigpu: ".join(hang.splitlines() + [f"logs of every rank: {log_dir}"]))
        return watchdog.EXIT_HANG

    usage = _usage_error(failures, texts, ours=on_usage_error is not None)
    if usage is not None:  # bad input: one line, as in one process (rank 0's is on the console)
        line, said = usage
        every_rank_shown = bool(_stderr_logs(launch, 0))  # --tee: rank 0 logged, all on the console
        if not said and line and not every_rank_shown:
            print(line, file=sys.stderr, flush=True)
        if on_usage_error is not None:
            on_usage_error()
        return 2

    rank, first = min(failures, key=lambda item: (_blame(item[1], texts[item[0]]),
                                                  failures.index(item)))
    stopped_late = _stopped_after_its_error(first)
    what = ("exit code 1, then the agent's SIGTERM as it exited" if stopped_late
            else _how(first).replace("exit", "exit code"))
    on = f" on {node}" if node else ""
    lines = [f"rank {rank} failed first{on} ({what}, local rank {first.local_rank}, pid {first.pid})"]
    lines.append(_its_error(rank, first, failures, texts, launch, ours))
    others = [f"rank {r} ({_how(f)})" for r, f in failures if r != rank]
    if others:
        lines.append("also stopped: " + ", ".join(others))
    lines.append(f"logs of every rank: {log_dir}")
    err("\nmultigpu: ".join(lines))
    if stopped_late:
        return 1  # its uncaught exception's code, had it finished exiting
    return first.exitcode if first.exitcode > 0 else 128 + abs(first.exitcode)


def _blame(failure, text: str | None) -> int:
    """A failed rank's place in the blame, the likeliest cause lowest (ties go to the rank the
    agent saw fail first): a rank's own error (also one the agent stopped while it exited after writing its
    error: _stopped_after_its_error); killed by a signal other than the agent's SIGTERM (the OOM
    killer's SIGKILL, a segfault); one we cannot read (on the console); a communication error,
    most often the echo of a crash elsewhere; stopped by the agent."""
    if _stopped_after_its_error(failure):
        return 0
    if failure.exitcode == -signal.SIGTERM:
        return 4
    if failure.exitcode < 0:
        return 1
    if text is None:
        return 2
    return 3 if _echo(failure, text) else 0


def _stopped_after_its_error(failure) -> bool:
    """A rank whose script raised (the worker wrote the traceback to its error file and exits 1)
    and that the agent's SIGTERM reached while it was still exiting (tearing down its process
    group, joining threads): its peers' echo of its lost connection ended them first. Its own
    error, not an echo: it failed first. A rank stopped in the middle of its work writes no error
    file of its own (a `multigpu: error:` line is _usage_error's)."""
    if failure.exitcode != -signal.SIGTERM:
        return False
    text = error_text(getattr(failure, "error_file_data", None) or {})
    return bool(text) and text.lstrip().startswith("Traceback") and not is_echo(text)


def _its_error(rank: int, first, failures: list, texts: dict, launch: list[Path], ours: bool) -> str:
    """The report's line on the error of the rank that failed first: its traceback, or where it
    already is (local rank 0 without --tee writes to the console, unless its error was left to
    this report), or why there is none."""
    if first.exitcode < 0 and not texts[rank]:  # a signal: Python printed nothing
        return (f"{first.signal_name()} ended it, so it left no traceback"
                + (" (kill -9, or the kernel's out-of-memory killer: `dmesg` says which)"
                   if first.exitcode == -signal.SIGKILL else ""))
    if not _stderr_logs(launch, first.local_rank) and not left_to_the_report(texts[rank], ours=ours):
        return "its traceback is in its output above"
    twin = _same_error_shown_above(failures, texts, rank, launch)
    if twin is not None:  # two ranks failed the same way: one traceback on the console is enough
        return f"its error is the one rank {twin} printed above: {_error_line(texts[rank])}"
    if texts[rank]:
        return f"---- rank {rank} traceback ----\n{texts[rank]}\n----"
    return "it wrote no traceback to stderr; see its logs"


def _same_error_shown_above(failures: list, texts: dict, rank: int, launch: list[Path]) -> int | None:
    """The rank on the console (local rank 0, without --tee) that failed on its own with the
    error `rank` failed with (the same last line), or None."""
    line = _last_line(texts[rank])
    if line is None or _stderr_logs(launch, 0):
        return None
    for r, f in failures:
        # local rank 0 may have printed its traceback and been stopped by the agent's SIGTERM
        # before its own exit: its text says whether it failed on its own
        ended = f.exitcode > 0 or f.exitcode == -signal.SIGTERM
        if r != rank and f.local_rank == 0 and ended and not is_echo(texts[r]) \
                and _last_line(texts[r]) == line:
            return r
    return None


def _error_line(text: str | None) -> str | None:
    """The first line of a traceback's exception (`RuntimeError: Expected ...`, whose message
    may go on over several lines), else the text's last line."""
    lines = (text or "").splitlines()
    starts = [k for k, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        for line in lines[starts[-1] + 1:]:
            if line.strip() and not line[0].isspace():
                return line.strip()
    return _last_line(text)


def _last_line(text: str | None) -> str | None:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


def _usage_error(failures: list, texts: dict, ours: bool) -> tuple[str, bool] | None:
    """When every failed rank ended with one `multigpu: error: ...` line (a UsageError: exit 2),
    that line (None: only on the console) and whether local rank 0, whose output is on the
    console, said one too; else None. Ranks that only echo the failure (stopped by the agent's
    SIGTERM, or a communication error as their last line) do not count against it: one rank may
    meet a bad file mid-epoch. `ours`: the workers are multigpu's own commands, whose exit 2 always
    said such a line, also where it went to the console and cannot be read back."""
    lines, console = [], False
    for rank, f in failures:
        text = (texts[rank] or "").strip()
        said = "\n" not in text and text.startswith("multigpu: error: ")
        # A rank the agent stopped while it was exiting on its own line (after printing it, it
        # still tears down) said that line: it is counted, so local rank 0's is not said twice.
        one_line = (f.exitcode == 2 and (not text or said)) or (f.exitcode == -signal.SIGTERM and said)
        if not one_line:
            if _echo(f, text):
                continue  # checked only here: a usage error may name a timeout
            return None
        console = console or f.local_rank == 0
        lines += [text] if text else []
    if not lines and not (ours and console):  # nothing said it: the full report, pointing at the console
        return None
    return (lines[0] if lines else None), console


def _echo(failure, text: str | None) -> bool:
    """A rank that only echoes a failure elsewhere: stopped by the agent's SIGTERM, or ended on a
    communication error (a lost peer)."""
    return failure.exitcode == -signal.SIGTERM or is_echo(text)


def _failure_text(failure, launch: list[Path], max_lines: int = 60) -> str | None:
    """The error a failed rank left: its error file (multigpu's workers and @record write one)
    or the end of its stderr log; from its last traceback on, at most `max_lines` lines."""
    text = error_text(getattr(failure, "error_file_data", None) or {})
    if text is None and (logs := _stderr_logs(launch, failure.local_rank)):
        text = logs[-1].read_text(errors="replace")
    text = (text or "").rstrip()
    if text.startswith(watchdog.HANG_HEADER):  # the watchdog's summary: a line per rank, whole
        return text
    start = text.rfind("Traceback (most recent call last)")
    lines = (text[start:] if start >= 0 else text).splitlines()
    return "\n".join(lines[-max_lines:]) or None


def _launch_folders(log_dir: str, failures: list, since: float | None) -> list[Path]:
    """The folders of this launch's logs under log_dir (torchrun's <run id>_<suffix>/, holding
    attempt_<n>/<local rank>/). Where a failed rank left an error file, its path names the folder
    (torch keeps the path only where the file exists); else the folders made or written to since
    the launch began at `since` (time.time()); else every one. A run resumed in its folder has the
    earlier launches' logs beside this one's: another launch's --tee must not count."""
    files = [Path(str(getattr(f, "error_file", ""))) for f in failures]
    named = {p.parent.parent.parent for p in files
             if p.name == "error.json" and p.parent.parent.name.startswith("attempt_")}
    if named:
        return sorted(named)
    folders = sorted(p for p in Path(log_dir).glob("*") if p.is_dir())
    ours = [p for p in folders if since is not None and p.stat().st_mtime >= since - 1]
    return ours or folders


def _stderr_logs(launch: list[Path], local_rank: int) -> list[Path]:
    """stderr.log files of a local rank in this launch's folders, oldest attempt first (none: it
    wrote to the console)."""
    return sorted((p for folder in launch for p in folder.glob(f"attempt_*/{local_rank}/stderr.log")),
                  key=lambda p: p.stat().st_mtime)


def _how(failure) -> str:
    return (f"signal {failure.signal_name()}" if failure.exitcode < 0
            else f"exit {failure.exitcode}")
