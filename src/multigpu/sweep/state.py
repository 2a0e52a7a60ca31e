"""A sweep's folder: what it runs, where each run stands, and who is running it.

    DIR/sweep.json        the sweep (command, grid, include, exclude) and its options; a re-run
                          must be the same sweep (its command may not change), its grid may grow
    DIR/sweep.lock        held (flock) by the one sweep process working in DIR
    DIR/sweep.log         what happened, one line per event
    DIR/state/NAME.json   each run's status: pending, running, done, failed or stopped
    DIR/runs/NAME/        each run's folder (multigpu train's --out; {out} in other commands)
    DIR/logs/NAME.log     each run's console output, every attempt appended
    DIR/attempts/NAME-K/  an attempt's folder that ended without a checkpoint to resume from
    DIR/compile-cache/    torch.compile's cache, shared by the runs
    DIR/summary.csv, summary.md, summary.png
    DIR/slurm/            --on slurm: submitit's job scripts, pickles and each job's own log

Only the process holding sweep.lock writes state files (atomically); `--status` reads them from
anywhere. The lock is a flock, so a sweep killed with -9 leaves no stale lock. On SLURM each
array task writes its own run's state file and rewrites the summary under summary.lock.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from multigpu.core.system import fileio, locks
from multigpu.core.errors import UsageError
from multigpu.core.system.orphans import alive
from multigpu.train.rundir import folder_users

SWEEP_JSON, LOCK, LOG = "sweep.json", "sweep.lock", "sweep.log"
STATUSES = ("done", "running", "failed", "stopped", "pending")


@dataclass
class RunState:
    name: str
    params: dict
    status: str = "pending"
    attempts: int = 0
    started: float | None = None  # time.time() of the last attempt's start
    ended: float | None = None
    exit_code: int | None = None
    note: str = ""  # why it failed or stopped, one line
    devices: str = ""
    pid: int | None = None
    job: str = ""  # the SLURM job running it (--on slurm): 1234_5, an array's task
    job_start: str = ""  # that job and its requeues, 1234_5#0 (pairs the nodes' attempts)
    history: list = field(default_factory=list)  # [{"attempt", "status", "duration_s", "note"}]

    @property
    def duration_s(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended or time.time()) - self.started


class SweepFolder:
    def __init__(self, root: Path):
        self.root = Path(root)
        self._lock_fd: int | None = None

    # layout
    def run_dir(self, name: str) -> Path:
        return self.root / "runs" / name

    def run_lives(self, st: RunState) -> bool:
        """Whether a process of the run `st` records still lives (run_alive, with its folder)."""
        return run_alive(st.pid, st.started, self.run_dir(st.name))

    def run_log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def state_file(self, name: str) -> Path:
        return self.root / "state" / f"{name}.json"

    @property
    def log_path(self) -> Path:
        return self.root / LOG

    @property
    def compile_cache(self) -> Path:
        return self.root / "compile-cache"

    # the sweep itself
    def read_sweep(self) -> dict | None:
        path = self.root / SWEEP_JSON
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError:
            raise UsageError(f"{path} is damaged (not JSON); move it away to start the sweep "
                             "afresh in this folder") from None

    def write_sweep(self, record: dict) -> None:
        fileio.atomic_write_text(self.root / SWEEP_JSON, json.dumps(record, indent=2) + "\n")

    # runs
    def read_state(self, name: str) -> RunState | None:
        path = self.state_file(name)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        known = RunState.__dataclass_fields__
        return RunState(**{k: v for k, v in data.items() if k in known})

    def write_state(self, state: RunState) -> None:
        fileio.atomic_write_text(self.state_file(state.name), json.dumps(asdict(state)) + "\n")

    def all_states(self) -> list[RunState]:
        folder = self.root / "state"
        found = [self.read_state(p.stem) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
        return [s for s in found if s is not None]

    # who works here
    def lock(self) -> bool:
        """Take sweep.lock; False when another live sweep holds it."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, fileio.FILE_MODE)
        # tries over ~80 ms: --status looks with a shared lock for an instant
        if locks.lock(fd, wait=0.08, poll=0.02) is not True:  # no flock here: refused too
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        return True

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def holder_pid(self) -> int | None:
        """The pid of the live sweep working here, or None."""
        path = self.root / LOCK
        if not path.is_file():
            return None
        fd = os.open(path, os.O_RDONLY)
        try:
            if locks.lock(fd, shared=True):
                return None  # free (the shared lock goes with the close below)
            try:
                return int(path.read_text().split()[0])
            except (ValueError, IndexError, OSError):
                return -1
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def summary_lock(self):
        """Held while reading every state and writing the summary: SLURM tasks that end together
        would otherwise each write a summary missing the other's result."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / "summary.lock", os.O_RDWR | os.O_CREAT, fileio.FILE_MODE)
        try:
            locks.lock(fd, wait=None)  # where flock is unsupported, written unlocked
            yield
        finally:
            os.close(fd)

    def event(self, message: str, echo=None) -> None:
        """One line in sweep.log (and through `echo`, on the console)."""
        line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}"
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")
        if echo is not None:
            try:
                echo(line)
            except OSError:  # the console is gone (a closed terminal, a killed `| tee`)
                pass


def run_alive(pid: int | None, started: float | None = None, out: Path | None = None) -> bool:
    """Whether a process of the run whose state records `pid` still lives, e.g. stopping after its
    sweep died. The run is a session of its own (setsid), and what it started stays in it, in
    another process group too (its loader workers): any live process of that session counts, and
    the pid itself (a forked run an instant before its setsid). A process holding the pid that
    began after the run's `started` is another one, that got the pid once the run had ended.
    The ranks of a run of several processes are sessions of their own (torch's agent starts them
    so); `multigpu train` ranks hold their run folder `out` while they live, which counts too."""
    if out is not None and folder_users.in_use(out):
        return True
    if not pid or pid < 0:
        return False
    if not alive(pid):
        return _session_alive(pid)
    return started is None or not _born_after(pid, started)


def _born_after(pid: int, started: float) -> bool:
    import psutil

    try:
        return psutil.Process(pid).create_time() > started + 1.0
    except psutil.Error:
        return False


def _session_alive(sid: int) -> bool:
    try:
        pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:  # no /proc (macOS): its process group
        try:
            os.killpg(sid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, though not ours to signal
            pass
        return True
    for p in pids:
        try:
            if os.getsid(p) == sid and alive(p):
                return True
        except OSError:  # gone meanwhile
            pass
    return False


def log_tail(path: Path, lines: int = 8, width: int = 300) -> str:
    """The last lines of a run's log, for the reason it failed."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    kept = [ln.rstrip()[:width] for ln in text.splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])


def last_error_line(tail: str) -> str:
    """The line of a log tail that says what went wrong (the last `...Error: ...` or
    `multigpu: error: ...`), else its last line."""
    lines = tail.splitlines()
    for ln in reversed(lines):
        s = ln.strip()
        if "error:" in s.lower() or (s.split(":", 1)[0].endswith(("Error", "Exception")) and ":" in s):
            return s
    return lines[-1].strip() if lines else ""


def format_duration(seconds: float | None) -> str:
    """12s, 4m 05s, 2h 03m; "-" for none."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"
