"""Why the launcher's agent stops the ranks, for a rank that gets its SIGTERM to say.

torch's agent stops every rank with SIGTERM when one rank failed, just as when the launcher was
asked to stop (Ctrl-C, a scheduler's SIGTERM): the ranks cannot tell the two apart, and a rank
that saves on SIGTERM said "SIGTERM: the ranks stop together ..." after a peer's crash that
nobody had signalled. Before the agent stops the ranks of an attempt that failed, the launcher
writes which local ranks ended and how beside the attempt's error files
(<log dir>/<run id>/attempt_<n>/STOPPING); a rank that gets SIGTERM reads it from there (its
TORCHELASTIC_ERROR_FILE is <attempt folder>/<local rank>/error.json). A stop the launcher was
asked for writes nothing. Ranks of other nodes, stopped through the rendezvous, find nothing
either. Torch-free.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

FILE = "STOPPING"
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
    folders = {Path(p).parent.parent for p in error_files.values() if p and p != os.devnull}
    if len(folders) != 1 or not ended:
        return
    said = ", ".join(f"local rank {rank} {how_it_ended(code)}" for rank, code in sorted(ended.items()))
    try:  # the first close of the attempt says it; the agent closes it again at the launch's end
        with open(folders.pop() / FILE, "x") as f:
            f.write(said + "\n")
    except OSError:  # there already, or not written: never a failed stop
        pass


def read(env=os.environ) -> str | None:
    """What the launcher wrote for this rank's attempt, or None."""
    here = env.get("TORCHELASTIC_ERROR_FILE")
    if not here:
        return None
    try:
        return (Path(here).parent.parent / FILE).read_text().strip() or None
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
