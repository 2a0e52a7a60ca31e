"""Which rank holds the others back: each rank's own time of every epoch, apart from its waiting.

DDP's all-reduce evens the ranks' step times out (a fast rank waits in it for the slowest), so a
slow GPU, host or loader is invisible in them. Here each rank times, per training step, its wait
for the batch (the prepared training loader's fetch) and its compute up to its gradients being
ready: from its model's forward (the module inside DDP: after DDP's own start of the step, a
buffer broadcast among it) to the last gradient accumulated in the backward (a post-accumulate-
grad hook of each parameter; the last one to fire is the step's end of its own work, before DDP
waits for the all-reduces of the other ranks). On a GPU both ends are CUDA events recorded on
the stream, read at the epoch's end only: no host-device sync in a step. On a CPU, the host's
clock. Parameter hooks, not a DDP communication hook: a model can have one communication hook
only, and that stays the user's (bf16 compression, say).

At the end of each training epoch (the prepared training loader's last batch taken, with
gradients on) the ranks gather their figures (one collective), and rank 0 judges them:

- a rank whose own time a typical batch (wait for data + compute, each the median over the
  epoch's batches) is more than SLOW over the median of the others', and by at least MIN_MS, is
  slow in that epoch. SLOW = 25 %: a rank that much slower costs every rank a fifth of its time;
  a chosen figure, not one measured on GPUs. MIN_MS = 5 ms: at steps of 1-2 ms on a CPU shared
  with other work nothing relative holds. In three 20-epoch even runs of two ranks on our
  2-core VM (load 5-12) the slower rank was up to 337 % over the other in an epoch; with epoch
  means, 14 ms once, twice in a row once (a false report); with the medians, under 5 ms in all
  but 1 and 2 epochs of two runs (12 and 15 ms: a burst of other work as long as a 7-batch
  epoch), never two in a row;
- it is named when the same rank is slow in two epochs in a row (a burst of other work on one
  machine is not), and in each epoch after while it stays so:

      rank 3 (host b, GPU 3) computes 31 % slower than the others: they wait 9 ms a step for it
      rank 1 (host a, CPU process 1) waits 12 ms a step for its data, the others 0.1 ms: they
      wait 12 ms a step for it

The library's prepared model says it as a warning on rank 0; `multigpu train` puts it on its
epoch line and every rank's figures into metrics.jsonl (`ranks`, from `take()`).
Set MULTIGPU_STRAGGLERS=0 to time nothing (the benchmark of its cost does).
"""
from __future__ import annotations

import os
import socket
import statistics
import time

import torch

from multigpu.core import console

SLOW = 0.25
MIN_MS = 5.0
ENV = "MULTIGPU_STRAGGLERS"


def device_name(device: torch.device, local_rank: int) -> str:
    return f"GPU {device.index}" if device.type == "cuda" else f"CPU process {local_rank}"


def slowest(ranks: list[dict]) -> dict | None:
    """The rank that is slow in one epoch's figures (`rank`, `data_ms`, `compute_ms` a step,
    `host`, `device`), with `kind` ('data' or 'compute'), `over` (its share over the others'
    median) and `wait_ms` (what the others wait a step for it); None when no rank is."""
    if len(ranks) < 2:
        return None
    own = [r["data_ms"] + r["compute_ms"] for r in ranks]
    i = max(range(len(ranks)), key=own.__getitem__)
    others = [r for j, r in enumerate(ranks) if j != i]
    base = statistics.median(own[j] for j in range(len(ranks)) if j != i)
    wait = own[i] - base
    if wait < MIN_MS or wait <= SLOW * base:
        return None
    data = ranks[i]["data_ms"] - statistics.median(r["data_ms"] for r in others)
    compute_base = statistics.median(r["compute_ms"] for r in others)
    kind = "data" if data > ranks[i]["compute_ms"] - compute_base else "compute"
    over = ranks[i]["compute_ms"] / compute_base - 1 if compute_base > 0 else float("inf")
    return {**ranks[i], "kind": kind, "over": over, "wait_ms": wait,
            "others_data_ms": statistics.median(r["data_ms"] for r in others)}


def sentence(slow: dict) -> str:
    who = f"rank {slow['rank']} (host {slow['host']}, {slow['device']})"
    tail = f": they wait {slow['wait_ms']:.0f} ms a step for it"
    if slow["kind"] == "compute" and slow["over"] >= 1:
        return f"{who} computes {slow['over'] + 1:.1f}x as long as the others{tail}"
    if slow["kind"] == "compute":
        return f"{who} computes {slow['over'] * 100:.0f} % slower than the others{tail}"
    return (f"{who} waits {slow['data_ms']:.0f} ms a step for its data, the others "
            f"{slow['others_data_ms']:.1f} ms{tail}")


def ranks_record(taken: tuple[list[dict], str | None] | None) -> dict:
    """An epoch's metrics.jsonl keys: `ranks` (each rank's figures), `straggler` (the sentence)."""
    if taken is None:
        return {}
    ranks, said = taken
    return {"ranks": ranks, **({"straggler": said} if said else {})}


class Judge:
    """Names a rank once it is slow in two epochs in a row (and while it stays so)."""

    def __init__(self):
        self._before: int | None = None

    def epoch(self, ranks: list[dict]) -> str | None:
        slow = slowest(ranks)
        rank = None if slow is None else slow["rank"]
        named = slow is not None and rank == self._before
        self._before = rank
        return sentence(slow) if named else None


class _Clock:
    """Marks of a step's ends: CUDA events on the stream (read at the epoch's end), or the host's
    clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, spans: list[tuple]) -> list[float]:
        """Seconds of each (start, end) pair of marks; on a GPU waits for the last end (once)."""
        if not self.cuda:
            return [b - a for a, b in spans]
        if spans:
            spans[-1][1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in spans]


def _typical(waits: list[float], computes: list[float]) -> tuple[float, float]:
    """A typical batch's wait and compute: the medians over the epoch's batches. A burst of other
    work on the machine (a preemption) moves a few batches, a slow rank all of them: the mean of
    an epoch of 7 batches on our loaded 2-core VM moved by 14 ms for one such burst."""
    if not computes:
        return 0.0, 0.0
    return statistics.median(waits), statistics.median(computes)


class Stragglers:
    """One per Runtime of several ranks. `watch(model)`: a DDP model's steps; `watch_loader()`:
    whether a prepared loader's waits count (a training one); `waited`, `epoch_end`: from it."""

    def __init__(self, env, device: torch.device):
        self.env, self.device = env, device
        self.on = env.world_size > 1 and os.environ.get(ENV, "1") != "0"
        self.say = True  # `multigpu train` says it on its epoch line instead
        self._clock = _Clock(device)
        self._judge = Judge()
        self._watched = False
        self._start = self._ready = self._last = self._ender = None
        self._batches: list[tuple] = []  # (wait for it, compute start, gradients ready) a batch
        self._wait = 0.0  # the wait for the batch in progress
        self._taken: tuple[list[dict], str | None] | None = None

    def watch(self, model) -> None:
        if not self.on or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return
        self._watched = True
        model.module.register_forward_pre_hook(self._forward)
        for p in model.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def counts(self, loader) -> bool:
        """Whether `loader`'s waits and epochs count: a loader that shuffles, of a watched run."""
        return self.on and bool(getattr(getattr(loader, "sampler", None), "shuffle", False))

    def _forward(self, module, args) -> None:
        if torch.is_grad_enabled() and self._start is None:  # a batch's forward
            self._start = self._clock.now()

    def _grad_ready(self, param) -> None:
        """A parameter's gradient is ready: on a CPU the time of each (the last one stays); on a
        GPU an event only at the parameter whose gradient came last in the batch before (the
        first batch: at each), as events cost more than a clock's read."""
        if self._start is None:
            return
        self._last = param
        if not self._clock.cuda:
            self._ready = time.perf_counter()
        elif self._ender is None or param is self._ender:
            self._ready = self._clock.now()

    def waited(self, seconds: float) -> None:
        """The training loop waited `seconds` for its next batch (the batch before is done)."""
        if torch.is_grad_enabled():
            self._batch_done()
            self._wait = seconds

    def _batch_done(self) -> None:
        if self._start is not None and self._ready is not None:
            self._batches.append((self._wait, self._start, self._ready))
            self._start = self._ready = None
        if self._clock.cuda and self._last is not None:
            self._ender = self._last

    def epoch_end(self, epoch: int) -> None:
        """The training loader's epoch ended (every rank: the same step). Collective."""
        if not torch.is_grad_enabled():
            return
        self._batch_done()
        data, compute = _typical([w for w, _, _ in self._batches],
                                 self._clock.seconds([(a, b) for _, a, b in self._batches]))
        mine = {"rank": self.env.rank, "host": socket.gethostname(),
                "device": device_name(self.device, self.env.local_rank),
                "data_ms": round(data * 1e3, 3), "compute_ms": round(compute * 1e3, 3)}
        self._batches = []
        ranks = self.env.all_gather_object(mine)
        said = self._judge.epoch(ranks) if self._watched else None
        self._taken = (ranks, said)
        if said and self.say and self.env.is_main:
            console.warn(f"epoch {epoch + 1}: {said}")

    def take(self) -> tuple[list[dict], str | None] | None:
        """The last epoch's figures of every rank and the sentence naming a slow one (or None);
        None when no epoch ended since the last take."""
        taken, self._taken = self._taken, None
        return taken
