"""One attempt of a sweep's run, before and after: its folder made ready (resume from its
checkpoint, or an attempt without one moved aside) and how it ended (done, stopped, failed and
why). Shared by the local sweep (scheduler.py) and each SLURM task (slurm_task.py), so a run
reads the same in sweep.json and --status wherever it ran.
"""
from __future__ import annotations

import signal

from multigpu.core.checkpoints.checkpoint_schema import checkpoints_folder
from multigpu.sweep import spec as specs
from multigpu.sweep.state import RunState, SweepFolder, format_duration, last_error_line, log_tail


def classify(st: RunState, code: int, log_path, *, timed_out: bool = False,
             timeout_s: float | None = None, stopped_by: str | None = None) -> None:
    """An attempt's end in `st`: done, stopped (`stopped_by` says by whom) or failed (why: the
    timeout, the exit and the log's error line), and a line of its history."""
    if code == 0 and not timed_out:
        st.status, st.note = "done", ""
    elif stopped_by is not None:
        st.status, st.note = "stopped", stopped_by
    elif timed_out:
        st.status, st.note = "failed", f"timed out after {format_duration(timeout_s)}"
    else:
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        line = last_error_line(log_tail(log_path))
        st.status, st.note = "failed", f"{why}: {line}" if line else why
    st.history.append({"attempt": st.attempts, "status": st.status,
                       "duration_s": round(st.duration_s or 0, 1), "note": st.note})


def prepare_folder(folder: SweepFolder, spec: specs.SweepSpec, run: specs.Run, attempt: int) -> str | None:
    """The run's folder before an attempt: the --resume value for a train run that has a
    checkpoint; an attempt's folder without one is moved to attempts/ (kept, not reused)."""
    out = folder.run_dir(run.name)
    if specs.subcommand(spec.command) != "train":
        out.mkdir(parents=True, exist_ok=True)
        return None
    if any(checkpoints_folder(out).glob("*.pt")):
        return str(out)
    if out.exists():
        kept = folder.root / "attempts" / f"{run.name}-{attempt - 1}"
        kept.parent.mkdir(parents=True, exist_ok=True)
        out.rename(kept)
    out.parent.mkdir(parents=True, exist_ok=True)
    return None
