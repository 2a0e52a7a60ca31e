"""Decisions every rank takes at the same step: save a checkpoint now, stop now.

A checkpoint is a collective and a stop must happen at the same step on every rank, yet the reasons
arrive on one rank at a time: rank 0's clock says `--checkpoint-every 10m` has passed, SIGTERM
reaches rank 1 a moment before rank 0, the launcher dies, a background save fails on rank 0.
So after an optimizer step, at steps every rank computes the same way, the ranks exchange a few
integers (DistEnv.all_max, on the CPU: no GPU sync) and act on the result together.

The steps between exchanges adapt so that they come about every CHECK_SECONDS: rank 0 measures the
step time and the next interval travels with the exchange. A step-based cadence
(`--checkpoint-every 500`) needs no exchange and is exact; stops still wait for the next exchange.

Signals: the first SIGTERM, SIGUSR1 (SLURM's --signal) or SIGINT asks for a stop after the step in
progress, with a checkpoint; a second one ends the process at once (the last complete checkpoint
stays valid: every write is atomic). Where the launcher said it passed that signal on
(stop_reason.forwarded), one more of it is the same stop: `pkill -f`, SLURM's scancel and time
limit, and systemd's stop signal every process of a job, the launcher among them, so a rank gets
its own and the launcher's copy.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from multigpu.core import console, startup_sigint
from multigpu.core.errors import UsageError
from multigpu.launcher.rank import stop_reason

if TYPE_CHECKING:  # `multigpu train` parses --checkpoint-every before torch is imported
    from multigpu.core.distributed import DistEnv

CHECK_SECONDS = 1.0
MAX_INTERVAL = 1000
STOP_SIGNALS = tuple(s for s in (signal.SIGTERM, getattr(signal, "SIGUSR1", None), signal.SIGINT) if s)
# Stop reasons as numbers, so that ranks can agree with a maximum; higher wins.
_REASONS = ["", "SIGINT", "SIGTERM", "SIGUSR1", "launcher gone", "checkpoint save failed"]
_UNITS = {"s": 1, "m": 60, "h": 3600}


@dataclass(frozen=True)
class Cadence:
    """When to checkpoint inside an epoch: every `steps` steps, or every `seconds`, or never."""
    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> Cadence:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
        if not m:
            raise UsageError(f"--checkpoint-every {text}: use a number of steps (500), a time "
                             "(30s, 10m, 2h), or 0 for the end of each epoch only")
        value, unit = float(m.group(1)), m.group(2)
        if value == 0:
            return cls()
        if not unit:
            if value != int(value):
                raise UsageError(f"--checkpoint-every {text}: a number of steps is a whole number")
            return cls(steps=int(value))
        return cls(seconds=value * _UNITS[unit])

    def describe(self) -> str:
        if self.steps:
            return f"every {self.steps} steps"
        if self.seconds:
            return f"every {self.seconds / 60:g} min" if self.seconds >= 60 else f"every {self.seconds:g} s"
        return "at the end of each epoch"


@dataclass(frozen=True)
class Decision:
    save: bool
    stop: str | None  # why the run stops now, or None


class Control:
    def __init__(self, env: DistEnv, cadence: Cadence, *, clock=time.monotonic):
        self.env, self.cadence, self.clock = env, cadence, clock
        self._reason = 0
        self._signals: dict[int, int] = {}  # signal -> how many came
        self._next_check = 0
        self._last_check: tuple[int, float] | None = None  # (step, time) of the last exchange
        self._saved = (0, clock())  # (step, time) of the last checkpoint (or of the resume)

    # --- reasons to stop, from signal handlers and other threads (an int store is atomic) ------
    def request_stop(self, reason: str) -> None:
        self._reason = max(self._reason, _REASONS.index(reason))

    @property
    def stop_requested(self) -> str | None:
        return _REASONS[self._reason] or None

    @contextlib.contextmanager
    def signal_handlers(self):
        """Install the stop handlers for the duration (main thread only), then put back the old."""
        saved = {}
        try:
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is signal.SIG_IGN:  # nohup, or `&` in a script: keep that
                    continue
                with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                    saved[sig] = signal.signal(sig, self._on_signal)
            startup_sigint.over()  # a Ctrl-C no longer ends the rank at once: it stops together
            yield self
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        self._signals[signum] = self._signals.get(signum, 0) + 1
        copies = 2 if stop_reason.forwarded() == name else 1  # its own and the launcher's (docstring)
        if self._signals[signum] == 2 and copies == 2:
            return  # the same stop
        if sum(self._signals.values()) > copies:  # one more: stop now
            console.warn(f"{name} again: stopping at once; the last complete checkpoint is kept")
            signal.signal(signum, signal.SIG_DFL)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        why = stop_reason.read() if signum == signal.SIGTERM else None
        if why:  # the agent's SIGTERM after a rank of this node failed: no stop was asked for
            console.warn(f"stopping: {why}, and the launcher stops every rank; the last complete "
                         "checkpoint is kept")
        else:
            console.warn(f"{name}: the ranks stop together at their next exchange (about a second "
                         f"of steps), then save a checkpoint (send {name} again to stop at once)")
        self.request_stop(name)

    # --- the decision, after each optimizer step ---------------------------------------------------
    def saved(self, step: int) -> None:
        self._saved = (step, self.clock())

    def after_step(self, step: int) -> Decision | None:
        """None, or what every rank does now. Collective at the exchange steps: call it on every
        rank after every optimizer step, with the same `step` (batches since the run began)."""
        due_steps = bool(self.cadence.steps) and step - self._saved[0] >= self.cadence.steps
        if not self.env.is_distributed:
            stop = self.stop_requested
            return Decision(True, stop) if due_steps or stop or self._time_due() else None
        if step < self._next_check:
            return Decision(True, None) if due_steps else None
        now = self.clock()
        interval = 1  # until rank 0 has timed some steps
        if self.env.is_main and self._last_check is not None:
            last_step, last_time = self._last_check
            per_step = (now - last_time) / max(step - last_step, 1)
            interval = min(MAX_INTERVAL, max(1, math.floor(CHECK_SECONDS / max(per_step, 1e-6))))
        self._last_check = (step, now)
        reason, time_due, interval = self.env.all_max(
            [self._reason, int(self.env.is_main and self._time_due()), interval])
        self._next_check = step + interval
        stop = _REASONS[reason] or None
        if due_steps or time_due or stop:
            return Decision(True, stop)
        return None

    def agree_stop(self) -> str | None:
        """Whether any rank was asked to stop (collective: every rank, at the same point)."""
        return _REASONS[self.env.all_max([self._reason])[0]] or None

    def _time_due(self) -> bool:
        return bool(self.cadence.seconds) and self.clock() - self._saved[1] >= self.cadence.seconds
