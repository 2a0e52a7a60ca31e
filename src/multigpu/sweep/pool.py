"""The devices a sweep packs its runs onto: GPUs, or CPU cores for `--devices-per-run cpu:N`.

A run gets `per_run` units that are free at the moment it starts: not used by another of our
runs, not leased by another multigpu process (leases.py: a second sweep, a `multigpu train`
started by hand), and for GPUs not busy with someone else's process (devices.busy_reason, read
through NVML). The lease is taken all at once and handed to the run's process (its file
descriptors are inherited), so it lasts as long as the run does, even if the sweep dies first.

A GPU run sees only its GPUs (CUDA_VISIBLE_DEVICES); a CPU run is pinned to its cores and sees
no GPU.

Several runs a device (`--runs-per-gpu K`, `slots`): small runs use a few percent of a GPU, so K
of them share one. The sweep leases the device once, when its first run starts there, and gives
each run a duplicate of that lease's open file: flock belongs to the open file, so the lease lasts
while any of them lives (also after the sweep is gone), and every other multigpu process sees the
device as leased by the sweep, as with one run. Runs go to the device with the fewest first. The
same K applies to CPU cores (K runs pinned to one core), which only helps runs that mostly wait.
Without --runs-per-gpu, a GPU sweep finds K itself (auto_slots): one run a GPU until a run of
it has reported its peak memory (max_memory_gib in metrics.jsonl, after its first epoch), then
as many as fit that.
"""
from __future__ import annotations

import collections
import math
import os
import re
import time
from dataclasses import dataclass

from multigpu.launcher import devices, leases
from multigpu.core.errors import UsageError


@dataclass(frozen=True)
class Unit:
    key: str  # the lease key
    token: str  # CUDA_VISIBLE_DEVICES entry (a GPU) or the core number (a CPU core)
    info: object = None  # the GPU's GpuInfo, or None for a core


def parse_per_run(text: str) -> tuple[str, int]:
    """--devices-per-run: `N` GPUs or `cpu:N` cores."""
    m = re.fullmatch(r"\s*(cpu:)?(\d+)\s*", str(text).lower())
    if not m or int(m.group(2)) < 1:
        raise UsageError(f"--devices-per-run {text}: give a number of GPUs (2) or of CPU "
                         "processes (cpu:2), at least 1")
    return ("cpu" if m.group(1) else "cuda"), int(m.group(2))


class Pool:
    def __init__(self, kind: str, units: list[Unit], per_run: int, min_free_memory: float = 2.0,
                 slots: int | None = 1):
        self.kind, self.units, self.per_run = kind, units, per_run
        self.min_free_memory = min_free_memory
        self.slots_given = slots  # None: auto_slots decides (GPU runs)
        self.slots = slots or 1
        self.peak_gib = 0.0  # the largest peak a run reported (auto K)
        self.in_use: collections.Counter[str] = collections.Counter()  # key -> runs on it
        self._held: dict[str, leases.Lease] = {}  # our lease of each device with runs on it
        if per_run > len(units):
            what = "GPU" if kind == "cuda" else "CPU core"
            raise UsageError(f"--devices-per-run asks for {per_run} {what}s a run, but the sweep "
                             f"has {len(units)}; use --devices-per-run {'cpu:' if kind == 'cpu' else ''}"
                             f"{len(units)} or fewer")
        self._seen_at, self._busy = 0.0, {}

    def describe(self) -> str:
        what = "GPU" if self.kind == "cuda" else "CPU core"
        ids = ",".join(u.token for u in self.units)
        shared = ""
        if self.slots_given is None:
            shared = ", runs a GPU from their peak memory"
        elif self.slots > 1:
            shared = f", up to {self.slots} runs a {'GPU' if self.kind == 'cuda' else 'core'}"
        return f"{len(self.units)} {what}{'s' if len(self.units) != 1 else ''} ({ids}), " \
               f"{self.per_run} per run{shared}"

    def shared_cores(self) -> str | None:
        """The line a sweep says when K runs share each CPU core (--runs-per-gpu K): they take
        turns on it, so runs that compute gain nothing and each takes about K times as long."""
        if self.kind != "cpu" or self.slots <= 1:
            return None
        k = self.slots
        return (f"--runs-per-gpu {k} on CPU cores: {k} runs take turns on each core, so training "
                f"gains nothing and each run takes about {k}x as long; it helps only runs that "
                "mostly wait (on files, the network). For 1 run a core, leave --runs-per-gpu out")

    def capacity(self) -> int:
        """Runs at once when every device is free."""
        return len(self.units) * self.slots // self.per_run

    def busy(self) -> dict[str, str]:
        """Units not ours and not free now: key -> why (read at most every 2 s)."""
        if time.monotonic() - self._seen_at < 2.0:
            return self._busy
        busy = {}
        if self.kind == "cuda":
            fresh = {leases.gpu_key(g): g for g in _query()}
            for u in self.units:
                if self.in_use[u.key]:
                    continue
                why = devices.busy_reason(fresh.get(u.key, u.info), self.min_free_memory)
                if why is not None:
                    busy[u.key] = why
        else:
            for u in self.units:
                if not self.in_use[u.key] and (who := leases.holder(u.key)) is not None:
                    busy[u.key] = f"leased by {who}"
        self._seen_at, self._busy = time.monotonic(), busy
        return busy

    def take(self, note: str) -> tuple[list[Unit], leases.Lease] | None:
        """`per_run` free units, leased (the fewest runs first); None when not enough are free
        now. The lease's descriptors are the run's to keep; the pool keeps its own."""
        busy = self.busy()
        free = [u for u in self.units if self.in_use[u.key] < self.slots and u.key not in busy]
        if len(free) < self.per_run:
            return None
        chosen = sorted(free, key=lambda u: self.in_use[u.key])[: self.per_run]
        if not self._lease([u.key for u in chosen if not self.in_use[u.key]], note):
            self._seen_at = 0.0  # taken by someone else just now
            return None
        self.in_use.update(u.key for u in chosen)
        fds = [os.dup(fd) for u in chosen for fd in self._held[u.key].fds()]
        return chosen, leases.Lease(tuple(u.key for u in chosen), fds)

    def _lease(self, keys: list[str], note: str) -> bool:
        """Lease each of `keys` (devices without a run of ours yet), all or none."""
        got = {}
        for key in keys:
            lease = leases.try_lease([key], note)
            if lease is None:
                for held in got.values():
                    held.release()
                return False
            got[key] = lease
        self._held.update(got)
        return True

    def give_back(self, units: list[Unit]) -> None:
        self.in_use.subtract(u.key for u in units)
        for u in units:
            if self.in_use[u.key] <= 0:
                del self.in_use[u.key]
                self._held.pop(u.key).release()
        self._seen_at = 0.0

    def learn_peak(self, peak_gib: float) -> None:
        """Auto K: a run's peak memory is known; K follows the largest peak seen (it may go down:
        no new run then goes where K are)."""
        if self.slots_given is None and self.kind == "cuda":
            self.peak_gib = max(self.peak_gib, peak_gib)
            total = min(u.info.memory_total for u in self.units) / devices.GIB
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            self.slots = auto_slots(self.peak_gib, total, self.min_free_memory, cores // len(self.units))

    def environment(self, units: list[Unit]) -> dict[str, str]:
        env = {leases.HELD_ENV: ",".join(u.key for u in units)}
        if self.kind == "cuda":
            env.update(CUDA_VISIBLE_DEVICES=",".join(u.token for u in units),
                       CUDA_DEVICE_ORDER="PCI_BUS_ID")
            if self.slots > 1 and "OMP_NUM_THREADS" not in os.environ:  # K runs share its cores
                cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
                env["OMP_NUM_THREADS"] = str(max(1, cores // (len(self.units) * self.slots)))
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
            env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        return env

    def devices_arg(self, units: list[Unit]) -> str:
        """What multigpu train/run get as --devices (ids count within CUDA_VISIBLE_DEVICES)."""
        return f"cpu:{len(units)}" if self.kind == "cpu" else str(len(units))

    def label(self, units: list[Unit]) -> str:
        return ("GPU " if self.kind == "cuda" else "CPU core ") + ",".join(u.token for u in units)


# A run's GPU memory beyond its peak allocation: its CUDA context and the caching allocator's slack.
CONTEXT_GIB = 1.0
SLACK = 1.25


def auto_slots(peak_gib: float, total_gib: float, min_free_gib: float, cores_per_gpu: int) -> int:
    """Runs a GPU for runs that peak at `peak_gib` allocated (max_memory_gib): as many as fit in
    the GPU's memory less --min-free-memory, each taking SLACK x its peak + CONTEXT_GIB, and no
    more than the CPU cores per GPU (each run needs a core to feed it); at least 1."""
    each = SLACK * max(peak_gib, 0.0) + CONTEXT_GIB
    fit = math.floor(max(total_gib - min_free_gib, 0.0) / each)
    return max(1, min(fit, cores_per_gpu))


def _query() -> list:
    try:
        return devices.query_gpus()
    except devices.NvmlUnavailable:
        return []


def make_pool(spec: str, per_run: str, min_free_memory: float = 2.0, slots: int | None = None) -> Pool:
    """The pool from the sweep's --devices (auto, GPU ids 0,1,2, or cpu:K cores),
    --devices-per-run and --runs-per-gpu (`slots`; None: auto for GPUs, 1 for CPU cores)."""
    kind, n = parse_per_run(per_run)
    spec = spec.strip().lower()
    if kind == "cpu":
        cores = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else list(range(os.cpu_count() or 1)))
        if spec.startswith("cpu:"):
            k = devices.parse_devices(spec)[1]
            if k > len(cores):
                raise UsageError(f"--devices {spec}: this machine gives the sweep {len(cores)} "
                                 f"CPU cores; use --devices cpu:{len(cores)} or fewer")
            cores = cores[:k]
        elif spec != "auto":
            raise UsageError(f"--devices {spec} names GPUs, but --devices-per-run {per_run} runs "
                             "on CPU cores; use --devices cpu:K (K cores to share) or auto")
        units = [Unit(leases.cpu_key(c), str(c)) for c in cores]
        return Pool("cpu", units, n, min_free_memory, slots or 1)
    if spec.startswith("cpu"):
        raise UsageError(f"--devices {spec} is CPU cores, but --devices-per-run {per_run} asks "
                         f"for GPUs; use --devices-per-run cpu:{n}")
    visible = devices.visible_gpus(_query(), devices.user_cuda_visible())
    if not visible:
        raise UsageError(f"--devices-per-run {per_run}: this machine has no GPU; use "
                         f"--devices-per-run cpu:{n}")
    if spec != "auto":
        kind_, ids = devices.parse_devices(spec if "," in spec else spec + ",")
        if kind_ != "ids":
            raise UsageError(f"--devices {spec}: give the GPU ids the sweep may use (0,1,2,3) "
                             "or auto (all of them)")
        by_id = {v.id: v for v in visible}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise UsageError(f"--devices {spec}: GPU {missing[0]} does not exist; this machine "
                             f"has {len(visible)} (0-{len(visible) - 1})")
        visible = [by_id[i] for i in ids]
    units = [Unit(leases.gpu_key(v.info) if v.info.index >= 0 else f"gpu-{v.token}", v.token, v.info)
             for v in visible]  # a MIG slice: NVML gives it no index of its own, its token is unique
    if slots is None and n > 1:  # runs of several GPUs are not small ones
        slots = 1
    return Pool("cuda", units, n, min_free_memory, slots)
