"""Where each attempt of a launch got to, for the launcher's recovery figures (lost_devices):
rank 0 of `multigpu train` keeps, in <log dir>/steps-attempt<N>.txt, one fixed-width line

    <time.time() of its first optimizer step> <samples it started from> <samples reached> <steps>

rewritten in place (os.pwrite of 64 bytes, no rename, no sync: a few microseconds a step) after
every optimizer step, in launches that may restart (--max-restarts > 0: only a restart reads it).
Samples count over the run (the epochs before, and the position in this one): they say how far
a run got on any device count; steps are this attempt's optimizer steps.
The file outlives a rank killed with -9 (the kernel holds the page), so the launcher reads how
far the failed attempt got, and the time of the next attempt's first step, from here. Torch-free.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from multigpu.launcher.rank import watchdog

WIDTH = 64


def path_of(log_dir: str | Path, attempt: int) -> Path:
    return Path(log_dir) / f"steps-attempt{attempt}.txt"


@dataclass(frozen=True)
class Reached:
    """What one attempt's file says."""
    first_step_at: float  # time.time()
    start: int  # samples trained before this attempt's first step (its resume point)
    reached: int  # samples trained after its last step
    steps: int  # optimizer steps it trained

    def step_samples(self) -> float | None:
        """Samples per optimizer step in this attempt."""
        return (self.reached - self.start) / self.steps if self.steps else None


class StepRecord:
    """The writer, on rank 0 of a launched run (from_env: None elsewhere)."""

    def __init__(self, path: Path, start: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.start, self.first_at, self.steps = start, None, 0

    @classmethod
    def from_env(cls, is_main: bool, start: int, env=os.environ) -> StepRecord | None:
        log_dir = env.get(watchdog.LOG_DIR_ENV)
        if not is_main or not log_dir or "TORCHELASTIC_RUN_ID" not in env:
            return None
        if env.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":  # no restart: nobody reads it
            return None
        try:
            return cls(path_of(log_dir, int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)),
                       start)
        except (OSError, ValueError):  # figures must never stop the training
            return None

    def stepped(self, samples: int) -> None:
        """After an optimizer step, `samples` trained in the run so far."""
        if self.first_at is None:
            self.first_at = time.time()
        self.steps += 1
        line = f"{self.first_at:.6f} {self.start} {samples} {self.steps}"
        try:
            os.pwrite(self.fd, line.ljust(WIDTH - 1).encode() + b"\n", 0)
        except OSError:
            pass

    def close(self) -> None:
        os.close(self.fd)


def read(log_dir: str | Path, attempt: int) -> Reached | None:
    """The attempt's line, or None when it trained no step (or wrote no file)."""
    try:
        first, start, reached, steps = path_of(log_dir, attempt).read_text().split()
        return Reached(float(first), int(start), int(reached), int(steps))
    except (OSError, ValueError):
        return None
