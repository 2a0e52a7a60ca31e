"""`--decode auto`: where folder: JPEGs are decoded, chosen by timing each way on the real step.

A fixed rule (workers x their rate against the GPU's) picked the slower way by 16 % on a 4x H100
machine: what a worker manages in a job, and what the GPU's decode takes from its step, depend
on the model, the machine and the files. So the job measures. In the first epoch that has room
for it, after WARMUP steps, the ways take turns in windows (`Plan`): the loader workers alone
(cpu share 1), the GPU alone (0) and a hybrid (the workers decode a share of the samples, by
index), ROUNDS times each, the second round in reverse order. The workers read the share from
shared memory per sample (ImageFolderDataset.cpu_share), so a switch needs no restart; which
decoder makes a sample changes its pixels by a level or so, never which samples an epoch sees or
their crops.

Each window first lets `lag` steps pass: the batches the loader had queued (workers x
prefetch_factor, plus the GPU finishing threads') were made under the previous way. Then it times
`steps` steps (step plus wait for data, the device synchronised at both ends) and counts the
samples this rank's workers made meanwhile. A way's rate is the lower of what the loop consumed
and what the workers produced: a queue filled by the previous way flatters the first, a loop that
cannot keep up idles the workers and lowers the second; the lower is the way's steady rate
either way. Every rank switches at the same step; one all-reduce (max of the times) gives rank 0
the slowest rank's figures, and its pick is broadcast.

The pick is said in one line, written to the run folder (DECODE_FILE) and kept in every
checkpoint (checkpoint_schema.DECODE), so a resumed run uses it without measuring again. An
epoch too short for the trial keeps the rule's way (imagefolder.use_decode) and says so.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from multigpu.core import console
from multigpu.core.loading.prefetch_thread import batches_ahead
from multigpu.core.system import fileio
from multigpu.train.data import gpu_images

WARMUP = 10         # steps before the first window: the workers start, the step settles
MIN_WINDOW = 10     # timed steps of a window, at least
ROUNDS = 2
DECODE_FILE = "decode.json"


def mode_name(share: float) -> str:
    """How a cpu share is named in the line and the files."""
    return "cpu" if share >= 1 else "gpu" if share <= 0 else f"hybrid {share:.0%}"


def candidate_shares(workers: int) -> tuple[float, ...]:
    """The workers alone, the GPU alone and one hybrid: the rule's share where it splits the
    work, else half."""
    hybrid = gpu_images.hybrid_share(workers)
    return (1.0, 0.0, hybrid if 0.1 <= hybrid <= 0.9 else 0.5)


@dataclass(frozen=True)
class Plan:
    """The trial's windows, in steps of an epoch counted from where the epoch's loop began."""
    shares: tuple[float, ...]
    lag: int     # steps that pass after a switch before timing
    steps: int   # steps timed per window
    warmup: int = WARMUP
    rounds: int = ROUNDS

    @classmethod
    def for_loader(cls, shares, workers: int, prefetch_factor: int, finished_ahead: int) -> Plan:
        # the batches queued ahead when the share changes: each worker's prefetch, one in the
        # DataLoader's hands, and on a GPU those the finishing threads hold (`finished_ahead`:
        # prefetch_thread.batches_ahead; 0 on CPUs) plus one being handed over
        lag = workers * prefetch_factor + 1 + (finished_ahead + 1 if finished_ahead else 0)
        return cls(tuple(shares), lag, max(MIN_WINDOW, lag))

    @property
    def order(self) -> list[float]:
        """The share of each window: every way once per round, every other round reversed."""
        out = []
        for r in range(self.rounds):
            out += list(self.shares if r % 2 == 0 else reversed(self.shares))
        return out

    @property
    def total(self) -> int:
        return self.warmup + len(self.order) * (self.lag + self.steps)

    def events(self) -> list[tuple[int, str, int]]:
        """(step, what, window), in order: "switch" at a window's start, "start" once its lag
        has passed, "end" when its timed steps are done."""
        out = []
        for k in range(len(self.order)):
            begin = self.warmup + k * (self.lag + self.steps)
            out += [(begin, "switch", k), (begin + self.lag, "start", k),
                    (begin + self.lag + self.steps, "end", k)]
        return out


def rates(plan: Plan, windows: torch.Tensor, world_size: int) -> dict[float, float]:
    """Samples a second of each way. `windows` (n, 3) per window: global samples consumed,
    seconds (the slowest rank's), seconds per sample made by a rank's workers (the slowest
    rank's). A window's rate: the lower of what was consumed and what the ranks' workers made;
    a way's: the mean of its windows'."""
    per: dict[float, list[float]] = {s: [] for s in plan.shares}
    for share, (samples, seconds, per_made) in zip(plan.order, windows.tolist(), strict=True):
        consumed = samples / max(seconds, 1e-9)
        made = world_size / per_made if per_made > 0 else consumed
        per[share].append(min(consumed, made))
    return {s: sum(v) / len(v) for s, v in per.items()}


def pick(measured: dict[float, float]) -> float:
    return max(measured, key=lambda s: measured[s])


@dataclass
class DecodeTrial:
    """Runs the plan on the job's train loader (after_step), then keeps the pick for the run."""
    datasets: tuple          # (train, val) ImageFolderDatasets
    plan: Plan
    world_size: int
    device: torch.device
    out: Path | None = None  # the run folder, on rank 0
    chosen: dict | None = None
    _events: list = field(default_factory=list)
    _windows: list = field(default_factory=list)
    _mark: tuple = ()

    def state(self) -> dict | None:
        """What checkpoints keep: the pick and its rates once made, else None."""
        return self.chosen

    def load(self, chosen: dict | None) -> None:
        """A resumed run's pick (checkpoint_schema.DECODE): used as it is, nothing measured."""
        if chosen and "cpu_share" in chosen:
            self.chosen = dict(chosen)
            self._set(float(chosen["cpu_share"]))

    def begin_epoch(self, epoch: int, steps_left: int, steps_full: int) -> None:
        """Plans the trial into this epoch's loop when it has room; says so when no epoch can."""
        self._events = []
        if self.chosen is not None:
            return
        if steps_full < self.plan.total:
            share = self.datasets[0].cpu_share
            self.chosen = {"cpu_share": share, "rates": {}, "epoch": epoch, "measured": False}
            console.info(f"decode: an epoch has {steps_full} steps, fewer than the "
                         f"{self.plan.total} that timing each way needs: {mode_name(share)} "
                         "(the rule) kept; --decode cpu|gpu to choose")
        elif steps_left >= self.plan.total:
            self._events = self.plan.events()
            self._windows, self._epoch = [], epoch

    def after_step(self, cursor, env) -> None:
        """After an optimizer step of the epoch (cursor.steps since the loop began)."""
        while self._events and cursor.steps >= self._events[0][0]:
            _, what, k = self._events.pop(0)
            if what == "switch":
                self._set(self.plan.order[k])
            elif what == "start":
                self._mark = self._now(cursor)
            else:
                samples, seconds, made = (b - a for a, b in zip(self._mark, self._now(cursor)))
                self._windows.append([samples, seconds, seconds / made if made > 0 else 0.0])
                if not self._events:
                    self._decide(env)

    def _now(self, cursor) -> tuple[float, float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a sync point: the window's work is done
        return float(cursor.position), time.perf_counter(), float(self.datasets[0].made_count)

    def _decide(self, env) -> None:
        windows = torch.tensor(self._windows, dtype=torch.float64, device=env.device)
        times = env.all_reduce(windows[:, 1:].contiguous(), op="max")
        windows = torch.cat([windows[:, :1], times], dim=1).cpu()
        chosen = None
        if env.is_main:
            measured = rates(self.plan, windows, self.world_size)
            chosen = {"cpu_share": pick(measured), "epoch": self._epoch, "measured": True,
                      "rates": {mode_name(s): round(r, 1) for s, r in measured.items()}}
        self.chosen = env.broadcast_object(chosen)
        self._set(self.chosen["cpu_share"])
        if env.is_main:
            self._report()

    def _report(self) -> None:
        said = ", ".join(f"{name} {rate:,.0f}" for name, rate in self.chosen["rates"].items())
        console.info(f"decode: samples/s over {len(self.plan.order)} windows of "
                     f"{self.plan.steps} steps in epoch {self.chosen['epoch']}: {said}; "
                     f"{mode_name(self.chosen['cpu_share'])} kept for the run")
        if self.out is not None:
            fileio.atomic_write_text(Path(self.out) / DECODE_FILE,
                                     json.dumps(self.chosen, indent=1) + "\n")

    def _set(self, share: float) -> None:
        for dataset in self.datasets:
            dataset.cpu_share = share


def trial_for(data, rt, workers: int, prefetch_factor: int, out: Path | None) -> DecodeTrial | None:
    """The trial where --decode auto has a choice (imagefolder.use_decode set measure_decode)."""
    if not getattr(data.train, "measure_decode", False):
        return None
    ahead = batches_ahead(data.train.on_device_threads(rt.device)) if rt.device.type == "cuda" else 0
    plan = Plan.for_loader(candidate_shares(workers), workers, prefetch_factor, ahead)
    return DecodeTrial((data.train, data.val), plan, rt.world_size, rt.device,
                       out if rt.is_main else None)
