"""Console output: rank 0 speaks, the others stay quiet (trap 14).

Module-level state, one value a process: whether this process may print, and in whose words its
warnings name the library's API (errors.Text). A program that owns the process sets them once
with `configure()`: `multigpu train` its rank, and its flags for the API's names.
"""
from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

_enabled = True
_say = str  # a warning's message (an errors.Text, or a str) -> the words printed
console = Console(stderr=False, highlight=False, soft_wrap=True)


def configure(is_main: bool, say=None) -> None:
    """Whether this process prints; `say`: how its warnings are said (flagwords.say for a CLI)."""
    global _enabled, _say
    _enabled = is_main
    if say is not None:
        _say = say


def info(message: str) -> None:
    if _enabled:
        console.print(message, markup=False)


def warn(message: str) -> None:
    if _enabled:
        print(f"multigpu: warning: {_say(message)}", file=sys.stderr, flush=True)


class EpochProgress:
    """A progress bar for one epoch on rank 0, showing loss and throughput.

    `update()` is called every step but only reads the loss (a host-device sync point) when the
    bar is redrawn, at most every `refresh` seconds, so it does not slow the GPU down.
    """

    def __init__(self, total: int, description: str, refresh: float = 0.5):
        self.enabled = _enabled and console.is_terminal
        self.refresh = refresh
        self._last = 0.0
        self._samples = 0
        self._start = time.perf_counter()
        if self.enabled:
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]} samples/s"),
                TimeRemainingColumn(), console=console, transient=True)
            self._task = self._progress.add_task(description, total=total, loss="-", speed="-")
            self._progress.start()

    def update(self, samples: int, loss) -> None:
        self._samples += samples
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last < self.refresh:
            self._progress.advance(self._task)
            return
        self._last = now
        speed = self._samples / max(now - self._start, 1e-9)
        self._progress.update(self._task, advance=1, loss=f"{float(loss):.4f}", speed=f"{speed:,.0f}")

    def close(self) -> None:
        if self.enabled:
            self._progress.stop()
