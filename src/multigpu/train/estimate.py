"""What a run will take, from steps timed for real: said by `multigpu doctor` before a run, e.g.

    estimate   ~41 s an epoch (training 38 s, evaluation 2 s, checkpoint 1 s), ~34 min for 50
    epochs, 2.3 GPU-hours on 4 GPUs (from 20 measured steps, ±6 %); not in it: start-up, ...

and by `multigpu train` after its first timed steps; the run's closing line compares it with the
time its epochs took (`compared`), so that users learn how far to trust it.

The arithmetic: an epoch is a rank's training batches times the mean time of a measured batch,
plus its evaluation and its checkpoint pause where they were timed; the job is that times the
epochs; device-hours are the job's time times the devices (every device is held the whole time).
The ± is the measurement's spread as it bears on the estimate: the standard error of the timed
samples' mean, over the mean (doctor's single steps; train's groups of steps, which the host times
without waiting for the GPU, so single ones would only show it running ahead). On a machine shared
with other work it is wide, and says so. Pure: no torch.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

# A forward pass costs about a third of a training step's forward, backward and update (the
# backward does twice the forward's arithmetic): train's guess for evaluation until it is timed.
FORWARD_SHARE = 1 / 3
TOO_SHORT_S = 5.0  # a run shorter than this is not compared with its estimate: noise


def duration(seconds: float) -> str:
    """'4.04 s', '41.4 s', '1.67 min', '34 min', '5.2 h', '3.1 days': 3 significant figures (a
    0.1-s epoch said as '0.1 s' made its comparison with a 0.2-s one unreadable)."""
    for limit, unit, per in ((90, "s", 1), (90 * 60, "min", 60), (48 * 3600, "h", 3600)):
        if seconds < limit:
            return f"{_figures(seconds / per)} {unit}"
    return f"{_figures(seconds / 86400)} days"


def _figures(value: float) -> str:
    """`value` to 3 significant figures, never in exponent form."""
    return f"{value:.0f}" if value >= 1000 else f"{float(f'{value:.3g}'):g}"


def _hours(hours: float) -> str:
    if hours < 0.01:
        return "under 0.01"
    return f"{hours:.2f}" if hours < 10 else f"{hours:.0f}"


def spread(samples: list[float]) -> float:
    """The standard error of the samples' mean over the mean (0 for fewer than two)."""
    if len(samples) < 2:
        return 0.0
    mean = statistics.fmean(samples)
    return statistics.stdev(samples) / math.sqrt(len(samples)) / mean if mean > 0 else 0.0


@dataclass(frozen=True)
class Estimate:
    """`step_s`: a rank's mean time for one training batch; `batches`: a rank's batches an epoch
    (None: not known, the estimate is per step); `epochs`: the epochs to come (None: not known);
    `eval_s`, `checkpoint_s`: an epoch's evaluation and checkpoint pause, where timed (None: not);
    `leaves_out`: what the figures do not hold, in words."""
    step_s: float
    spread: float
    measured: int
    devices: int
    cuda: bool
    batches: int | None = None
    epochs: int | None = None
    eval_s: float | None = None
    checkpoint_s: float | None = None
    leaves_out: tuple[str, ...] = field(default_factory=tuple)

    @property
    def training_s(self) -> float:
        return self.step_s * (self.batches or 0)

    @property
    def epoch_s(self) -> float:
        return self.training_s + (self.eval_s or 0.0) + (self.checkpoint_s or 0.0)

    @property
    def total_s(self) -> float | None:
        return self.epoch_s * self.epochs if self.batches and self.epochs else None

    def device_hours(self) -> float | None:
        total = self.total_s
        return None if total is None else total * self.devices / 3600

    def line(self) -> str:
        """The estimate in one line (without doctor's `estimate` head)."""
        source = f"from {self.measured} measured step{'s' if self.measured != 1 else ''}, ±{self.spread * 100:.0f} %"
        if not self.batches:
            return self._tail(f"~{self.step_s * 1e3:.0f} ms a step ({source})")
        parts = [f"training {duration(self.training_s)}"]
        if self.eval_s is not None:
            parts.append(f"evaluation {duration(self.eval_s)}")
        if self.checkpoint_s is not None:
            parts.append(f"checkpoint {duration(self.checkpoint_s)}")
        text = f"~{duration(self.epoch_s)} an epoch of {self.batches} steps ({', '.join(parts)})"
        if self.total_s is not None:
            unit = "GPU" if self.cuda else "CPU"
            on = ("GPU" if self.cuda else "CPU process") + ("" if self.devices == 1 else "s" if self.cuda else "es")
            text += (f", ~{duration(self.total_s)} for {self.epochs} epoch{'s' if self.epochs != 1 else ''}, "
                     f"{_hours(self.device_hours())} {unit}-hours on {self.devices} {on}")
        return self._tail(f"{text} ({source})")

    def _tail(self, text: str) -> str:
        return f"{text}; not in it: {', '.join(self.leaves_out)}" if self.leaves_out else text


def compared(estimated: float, real: float, epochs: int) -> str:
    """The closing line's comparison: how long the epochs took against the estimate; a run of
    under TOO_SHORT_S seconds is not compared (its start and end weigh more than its steps)."""
    said = (f"estimate: the {epochs} epoch{'s' if epochs != 1 else ''} took {duration(real)}, "
            f"estimated ~{duration(estimated)}")
    if real < TOO_SHORT_S:
        return f"{said} (under {TOO_SHORT_S:g} s: too short a run to compare)"
    off = (real - estimated) / estimated if estimated > 0 else 0.0
    how = (f"{abs(off) * 100:.0f} % {'longer' if off > 0 else 'shorter'} than estimated"
           if abs(off) >= 0.005 else "as estimated")
    return f"{said} ({how})"


class FirstSteps:
    """Times a window of the first epoch's batches from the host: skips `skip` batches (the
    loader's start, the first step's own), then times groups of `group` batches until there are
    `measure` batches and `seconds` seconds in the window, or the epoch's last batch but one is
    reached (the last is often uneven). `after(batches)` after each optimizer step, with the
    batches trained so far in the epoch; `sync()` waits for the device, at the window's start and
    end only. A machine shared with other work runs its steps in bursts: on our 2-core VM (load
    5-10) windows of 20 steps of 25-40 ms came out 30-58 % under the epochs' mean in three runs,
    hence the time floor: the estimate comes after about 5 s of training, not 1."""

    def __init__(self, batches: int, *, skip: int = 5, measure: int = 20, group: int = 5,
                 seconds: float = 5.0, sync=None):
        self.skip = min(skip, batches // 5)
        self.limit = batches - 1
        self.measure, self.group, self.seconds = measure, group, seconds
        self.sync = sync or (lambda: None)
        self._marks: list[tuple[int, float]] = []
        self.samples: list[float] | None = None  # per-batch seconds of each group, once done

    @property
    def enough(self) -> bool:
        return self.limit - self.skip >= 2

    @property
    def measured(self) -> int:
        return self._marks[-1][0] - self._marks[0][0] if len(self._marks) > 1 else 0

    def after(self, batches: int) -> bool:
        """True once, when the window has just been timed (`samples` then holds it)."""
        if self.samples is not None or not self.enough or batches < self.skip:
            return False
        if not self._marks:
            self.sync()
            self._marks.append((batches, time.perf_counter()))
            return False
        first, began = self._marks[0]
        last = batches >= self.limit or (batches - first >= self.measure
                                         and time.perf_counter() - began >= self.seconds)
        if not last and batches - self._marks[-1][0] < self.group:
            return False
        if last:
            self.sync()
        self._marks.append((batches, time.perf_counter()))
        if not last:
            return False
        self.samples = [(t1 - t0) / (b1 - b0) for (b0, t0), (b1, t1) in zip(self._marks, self._marks[1:])]
        return True

    @property
    def spread(self) -> float:
        return spread(self.samples or [])

    @property
    def step_s(self) -> float:
        """Mean seconds a batch over the whole window."""
        (b0, t0), (b1, t1) = self._marks[0], self._marks[-1]
        return (t1 - t0) / (b1 - b0)
