"""Where a `multigpu train` job's wall time went, said once at its end on rank 0, e.g.

    time: 4.7 s since the command: 3.8 s starting (launch, data, model, resume), 0.2 s training,
    0.1 s evaluating, 0.0 s held up by checkpoints, 0.7 s other (metrics, plot)

The clock starts when the `multigpu train` command starts (the CLI puts the time in STARTED_ENV,
which the launched workers inherit), so the start-up counts as the user waits for it; a worker
started some other way counts from the start of its training. It stops at this line: the
processes' teardown and exit come after it. A run that stops early (a signal, an error) ends
with its own message instead. Pure: no torch.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

STARTED_ENV = "MULTIGPU_STARTED_AT"
PARTS = ("training", "evaluating", "checkpoints")


def mark_command_start(started: float, env=os.environ) -> None:
    """In the command the user typed (not in its workers): its start, for every process it launches."""
    env[STARTED_ENV] = repr(started)


def command_start(env=os.environ) -> float:
    """time.time() when the command started (STARTED_ENV), or now for a process without it."""
    try:
        return float(env[STARTED_ENV])
    except (KeyError, ValueError):
        return time.time()


@dataclass
class Timeline:
    started: float = field(default_factory=command_start)
    ready: float | None = None                      # time.time() when training could begin
    seconds: dict = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def mark_ready(self) -> None:
        self.ready = time.time()

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def summary(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        whole = now - self.started
        start = (self.ready or now) - self.started
        s = self.seconds
        other = whole - start - sum(s.values())
        return (f"time: {whole:.1f} s since the command: {start:.1f} s starting (launch, data, "
                f"model, resume), {s['training']:.1f} s training, {s['evaluating']:.1f} s evaluating, "
                f"{s['checkpoints']:.1f} s held up by checkpoints, {other:.1f} s other "
                "(metrics, plot)")
