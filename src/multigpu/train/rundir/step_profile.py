"""Where a run's steps go: a profile of a window of optimizer steps, asked for in the environment.

    MULTIGPU_PROFILE_STEPS=100-119 multigpu train ...

profiles steps 100 to 119 of the run (counted from its first step, over resumes) with
torch.profiler's CUDA activity on every rank (the kernels' own timestamps: the host is not slowed
down by the profiling of its own calls), and says on rank 0, once the window is done:

    profile of steps 100-119, rank 0: S ms a step: GPU busy B ms (training stream T, other
    streams O, all-reduce not overlapped N), GPU idle I ms, waiting for data W ms; slowest rank R
    at S' ms; trace: OUT/profile/trace-rank0.json (Perfetto, chrome://tracing)

A step whose GPU idles while the host does not wait for data is held up by the host (Python
launching kernels, a CPU shared with loader workers); one whose GPU is busy the whole step is
bound by the GPU. Each rank's numbers go to OUT/profile/rank<r>.json, rank 0's kernels to its trace.
Not a flag of `multigpu train`: a diagnosis, not a setting of the run (config.json does not get it).
Importing this module does not import torch (the command checks the variable before it does).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

from multigpu.core import console
from multigpu.core.errors import UsageError

ENV = "MULTIGPU_PROFILE_STEPS"
FOLDER = "profile"


def window_from_env(environ=os.environ) -> tuple[int, int] | None:
    """(first, last) step of MULTIGPU_PROFILE_STEPS ("100-119", or "100" for one step), or None."""
    text = environ.get(ENV, "").strip()
    if not text:
        return None
    m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", text)
    first, last = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, -1)
    if not m or first < 1 or last < first:
        raise UsageError(f"{ENV}={text}: give the steps to profile as FIRST-LAST, e.g. 100-119 "
                         "(counted from the run's first step, 1)")
    return first, last


def union_length(intervals) -> float:
    """Length covered by at least one of the (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total


def kernel_times(events: list[dict], steps: int) -> dict:
    """Per step, in ms, from a chrome trace's events: the GPU busy (any kernel or copy running),
    the training stream's busy time (the stream with the most kernel time), the other streams',
    NCCL's and NCCL's not overlapped by any computing kernel. Of one GPU, that of the training
    stream: a process that drives several (dp) has every GPU's kernels in its trace (its "pid")."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busiest = max(_by_stream(spans).items(), key=lambda kv: sum(b - a for a, b in kv[1]), default=None)
    spans = [e for e in spans if busiest is None or e.get("pid") == busiest[0][0]]
    by_stream = {stream: ivs for (_, stream), ivs in _by_stream(spans).items()}
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in spans if "nccl" in e["name"].lower()]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in spans
               if e["cat"] == "kernel" and "nccl" not in e["name"].lower()]
    per = 1000.0 * max(steps, 1)  # trace times are in microseconds
    main = max(by_stream, key=lambda s: sum(b - a for a, b in by_stream[s]), default=None)
    others = [iv for s, ivs in by_stream.items() if s != main for iv in ivs]
    return {"gpu_busy_ms": union_length(nccl + compute + others + by_stream.get(main, [])) / per,
            "training_stream_ms": union_length(by_stream.get(main, [])) / per,
            "other_streams_ms": union_length(others) / per,
            "nccl_ms": sum(b - a for a, b in nccl) / per,
            "nccl_exposed_ms": (union_length(nccl + compute) - union_length(compute)) / per,
            "kernels_per_step": sum(1 for e in spans if e["cat"] == "kernel") / max(steps, 1)}


def _by_stream(spans: list[dict]) -> dict:
    """(device, stream) -> the (start, end) of its spans."""
    streams: dict = {}
    for e in spans:
        streams.setdefault((e.get("pid"), e.get("args", {}).get("stream")), []).append((e["ts"], e["ts"] + e["dur"]))
    return streams


class StepProfile:
    """begin(step) before this launch's first step, after_step(step, waited) after every
    optimizer step: starts the profiler after the last optimizer step before step `first` and
    ends it after the first one that reaches step `last`. Steps count batches, as the run's logs
    do: with --accumulate N an optimizer step holds N of them and the window profiled is the
    whole optimizer steps that hold it (its rank<r>.json says which). `waited`: the rank's
    seconds so far waiting for batches in `epoch` (engine.EpochCursor.waited, which restarts
    each epoch: a window over an epoch's end adds the epoch's last to the next one's)."""

    def __init__(self, window: tuple[int, int], out: Path, rt):
        self.first, self.last = window
        self.out, self.rt = out / FOLDER, rt
        self._prof = None
        self._began = self._waited = 0.0
        self._from = 0  # the step after which the profiler started
        self._epoch, self._seen, self._ends = None, 0.0, 0  # the epoch and its wait at the last step
        self.done = False

    @classmethod
    def from_env(cls, out: Path, rt) -> StepProfile | None:
        """Rank 0's window on every rank: a node started without the variable (or with another
        window) profiles what rank 0 asked for, instead of leaving the others waiting for it in
        the profile's all-gather."""
        window = rt.env.broadcast_object(window_from_env())
        return cls(tuple(window), out, rt) if window else None

    def begin(self, step: int, epoch: int | None = None) -> None:
        """Before the first step of this launch (`step`: those trained before it, a resume's)."""
        self.after_step(step, 0.0, epoch)

    def after_step(self, step: int, waited: float, epoch: int | None = None) -> None:
        if self._prof is not None and epoch != self._epoch:  # the cursor's wait restarted
            self._waited -= self._seen
            self._ends += 1
        self._epoch, self._seen = epoch, waited
        if self._prof is None and not self.done and self.first - self.rt.accumulate <= step < self.last:
            self._from = step
            self._start(waited)
        elif self._prof is not None and step >= self.last:
            self._stop(step, waited)

    def _start(self, waited: float) -> None:
        from torch.profiler import ProfilerActivity, profile

        cuda = self.rt.device.type == "cuda"
        self._sync()
        self._prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
        self._prof.__enter__()
        self._began, self._waited = time.perf_counter(), waited

    def _sync(self) -> None:
        import torch

        if self.rt.device.type == "cuda":
            torch.cuda.synchronize(self.rt.device)

    def _stop(self, step: int, waited: float) -> None:
        self._sync()
        seconds = time.perf_counter() - self._began
        self._prof.__exit__(None, None, None)
        steps = step - self._from
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / f"trace-rank{self.rt.rank}.json"
        kept = self.rt.is_main
        path = trace if kept else _temporary_file()
        try:
            self._prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
        finally:
            if not kept:
                path.unlink(missing_ok=True)
        self._prof, self.done = None, True
        numbers = {"rank": self.rt.rank, "first": self._from + 1, "last": step, "epoch_ends": self._ends,
                   "step_ms": seconds * 1e3 / steps,
                   "waiting_for_data_ms": max(0.0, waited - self._waited) * 1e3 / steps,
                   **kernel_times(events, steps)}
        numbers["gpu_idle_ms"] = max(0.0, numbers["step_ms"] - numbers["gpu_busy_ms"])
        (self.out / f"rank{self.rt.rank}.json").write_text(json.dumps(numbers, indent=1) + "\n")
        every = self.rt.env.all_gather_object(numbers)
        if self.rt.is_main:
            console.info(summary(numbers, every, trace))

    def close(self) -> None:
        """At the run's end: a window it did not reach is said, an open profiler closed."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
        if not self.done and self.rt.is_main:
            console.warn(f"{ENV}: steps {self.first}-{self.last} were not all trained in this run: no profile")


def _temporary_file() -> Path:
    """A new empty file (its descriptor closed: the profiler writes it by name)."""
    descriptor, name = tempfile.mkstemp(suffix=".json")
    os.close(descriptor)
    return Path(name)


def summary(mine: dict, every: list[dict], trace: Path) -> str:
    slowest = max(every, key=lambda n: n["step_ms"])
    head = f"profile of steps {mine['first']}-{mine['last']}, rank {mine['rank']}: {mine['step_ms']:.1f} ms a step"
    tail = (f"slowest rank {slowest['rank']} at {slowest['step_ms']:.1f} ms; trace: {trace} "
            "(Perfetto, chrome://tracing)")
    if mine["epoch_ends"]:  # its time, kernels and waits are those of the steps and more
        tail += ("; the window holds the end of an epoch (its evaluation and checkpoint): profile "
                 "steps within one epoch for a step's own time")
    if not mine["kernels_per_step"]:  # a CPU run: its trace holds the host's operators
        return f"{head}, waiting for data {mine['waiting_for_data_ms']:.1f} ms; {tail}"
    return (f"{head}: GPU busy {mine['gpu_busy_ms']:.1f} ms (training stream "
            f"{mine['training_stream_ms']:.1f}, other streams {mine['other_streams_ms']:.1f}, all-reduce "
            f"not overlapped {mine['nccl_exposed_ms']:.1f}), GPU idle {mine['gpu_idle_ms']:.1f} ms, "
            f"waiting for data {mine['waiting_for_data_ms']:.1f} ms; {tail}")
