"""Why the launcher's agent stops the ranks, for a rank that gets its SIGTERM to say.

torch's agent stops every rank with SIGTERM when one rank failed, just as when the launcher was
asked to stop (Ctrl-C, a scheduler's SIGTERM): the ranks cannot tell the two apart, and a rank
that saves on SIGTERM said "SIGTERM: the ranks stop together ..." after a peer's crash that
nobody had signalled. Before the agent stops the ranks of an attempt that failed, the launcher
writes which local ranks ended and how beside the attempt's error files
(<log dir>/<run id>/attempt_<n>/STOPPING); a rank that gets SIGTERM reads it from there (its
TORCHELASTIC_ERROR_FILE is <attempt folder>/<local rank>/error.json). A stop the launcher was
asked for writes nothing there. Ranks of other nodes, stopped through the rendezvous, find nothing
either.

A stop signal the launcher passes on to its ranks is said beside it (FORWARDED, the signal's
name), before it is sent: `pkill -f`, SLURM's scancel, time limit and `--signal` without `B:`,
and systemd's stop signal every process of a job, so such a rank gets the signal twice, its own
and the launcher's copy, and takes the pair for one stop (train/control.py), not for the second
signal that stops it at once. Torch-free.
"""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

FILE = "STOPPING"
FORWARDED = "FORWARDED"
# the signals that ask a launch to stop (passed on to the ranks), not a death of their own
STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def stopped_by_signal(code: int | None) -> bool:
    """Whether an exit code says one of the stop signals stopped the process by its own exit
    (128 + N: a launch, a rank that saved and stopped), not a death by a signal (SIGKILL,
    SIGSEGV, SIGABRT; a negative code)."""
    names = {s.value: s.name for s in signal.Signals}
    return code is not None and code > 128 and names.get(code - 128) in STOP_SIGNALS.split(",")


def all_stopped_by_signal(codes) -> bool:
    """Whether there are exit codes and each says a stop signal's own exit (stopped_by_signal)."""
    codes = list(codes)
    return bool(codes) and all(map(stopped_by_signal, codes))


def each_stopped_by_itself(exit_codes: dict) -> int | None:
    """The exit code 128 + N by which every rank of an attempt stopped on a stop signal N (the
    ranks of multigpu train, after saving), or None."""
    codes = set(exit_codes.values())
    return codes.pop() if len(codes) == 1 and all_stopped_by_signal(codes) else None


def write(error_files: dict, ended: dict) -> None:
    """`ended`: local rank -> exit code (negative: the signal) of the ranks that failed, said in
    the attempt folder named by the agent's per-rank `error_files`."""
    if ended:
        write_line(error_files, ", ".join(f"local rank {rank} {how_it_ended(code)}"
                                          for rank, code in sorted(ended.items())))


def write_line(error_files: dict, said: str) -> None:
    """`said`: why the ranks of the attempt named by `error_files` are stopped (a failure here,
    or the nodes' sake: node_rendezvous.WHY), in its folder for them to read."""
    folder = _attempt_folder(error_files)
    if folder is None:
        return
    try:  # the first close of the attempt says it; the agent closes it again at the launch's end
        with open(folder / FILE, "x") as f:
            f.write(said + "\n")
    except OSError:  # there already, or not written: never a failed stop
        pass


def mark_forwarded(error_files: dict, sig: int) -> None:
    """Before the launcher passes stop signal `sig` on to the ranks of the attempt whose per-rank
    `error_files` these are: said in its folder (FORWARDED)."""
    folder = _attempt_folder(error_files)
    if folder is not None:  # the first one passed on is kept (the agent closes an attempt again)
        with contextlib.suppress(OSError, ValueError), open(folder / FORWARDED, "x") as f:
            f.write(signal.Signals(sig).name + "\n")  # not written: a rank counts it as its own


def read(env=os.environ) -> str | None:
    """What the launcher wrote for this rank's attempt, or None."""
    return _read(FILE, env)


def forwarded(env=os.environ) -> str | None:
    """The name of the stop signal the launcher passed on to this rank's attempt, or None."""
    return _read(FORWARDED, env)


def _attempt_folder(error_files: dict) -> Path | None:
    folders = {Path(p).parent.parent for p in error_files.values() if p and p != os.devnull}
    return folders.pop() if len(folders) == 1 else None


def _read(name: str, env) -> str | None:
    here = env.get("TORCHELASTIC_ERROR_FILE")
    if not here:
        return None
    try:
        return (Path(here).parent.parent / name).read_text().strip() or None
    except OSError:
        return None


def how_it_ended(code: int) -> str:
    """'was killed by SIGKILL' or 'exited with code 1', from a process's exit code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
