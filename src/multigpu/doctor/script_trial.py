"""A user's script run for its first optimizer step(s), through the real launcher, and what its
ranks saw: parameters without a gradient (trap 6), training DataLoaders that are not sharded,
the batch per rank, the peak memory (trap 2).

The script is started as `multigpu run` starts it (multigpu.launcher.rank.worker on every device of the plan,
the same working folder, its GPUs leased), with a trial folder of the doctor's own in the
environment; trial.py in each worker records what it sees and ends the process right after the
N-th optimizer step, before anything after it runs (checkpoints, the rest of training, `finally`
blocks), or at the trial's time limit when no such step comes (a weight update without torch.optim,
evaluation only, a stuck data loader): a trial never runs a script to its end. What the script
writes before then (an output folder, a log, a download) is written:
the doctor lists what appeared or changed under the working folder. The trial folder (records,
per-rank logs) is removed, unless a rank failed: then its logs are named.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

from multigpu.core.system.environ import environ_set
from multigpu.launcher import launch
from multigpu.launcher.rank import trial
from multigpu.core.findings import Finding

LoaderFindings = Callable[[list, int], list]  # (records, ranks) -> findings
GIB = 2**30
BACKSTOP_GRACE = 15.0  # seconds past the ranks' own time limit (and their wait for each other)
SNAPSHOT_LIMIT = 20000  # files under the working folder beyond which side effects are not listed
_SKIPPED_DIRS = {".git", "__pycache__"}
_FIX_UNUSED = ("remove the unused module, freeze it (requires_grad_(False)), or "
               "DistributedDataParallel(model, find_unused_parameters=True) (slower)")


def trial_findings(cmd: list[str], plan, steps: int, timeout: float,
                   loaders: LoaderFindings | None = None, *,
                   then: Callable[[list], list] | None = None) -> list[Finding]:
    """Run `cmd` (a multigpu.launcher.rank.worker command line) on every device of `plan` up to its `steps`-th
    optimizer step, for `timeout` seconds at most; the findings of what its ranks recorded
    (`loaders`: how its training DataLoaders are told, when not as a distributed script's).
    `then(records)`: more findings, from a trial that ended well (--scaling's on one device)."""
    root = Path.cwd()
    before = snapshot(root)  # the trial's folder is made after it
    run = run_trial(cmd, plan, steps, timeout)
    findings = record_findings(run.records, plan.nproc, steps, TrialEnd(run.code, timeout, run.killed),
                               logs=run.folder / "logs", loaders=loaders or _loader_findings)
    effects = side_effect_finding(before, snapshot(root, skip=run.folder), root)
    if then is not None and run.code == 0:
        findings += then(run.records)
    findings.append(effects)
    if run.code == 0:
        shutil.rmtree(run.folder, ignore_errors=True)
    return findings


@dataclass(frozen=True)
class Trial:
    """A trial's launch: its exit code, its ranks' records, its folder (records, logs), and
    whether the backstop killed it."""
    code: int
    records: list[dict]
    folder: Path
    killed: bool


def run_trial(cmd: list[str], plan, steps: int, timeout: float) -> Trial:
    """`cmd` launched on the plan's devices up to its `steps`-th optimizer step, in a trial
    folder of its own (the caller removes it)."""
    folder = Path(tempfile.mkdtemp(prefix="multigpu-doctor-"))
    env = {trial.TRIAL_DIR_ENV: str(folder), trial.TRIAL_STEPS_ENV: str(steps),
           trial.TRIAL_TIMEOUT_ENV: f"{timeout:g}"}
    backstop = Backstop(timeout + (trial.PEERS_WAIT_SECONDS if plan.nproc > 1 else 0) + BACKSTOP_GRACE)
    with environ_set(env), backstop:
        code = launch.launch(cmd, plan, launch.LaunchOptions(log_dir=str(folder / "logs")),
                             python=False, reporting=launch.Reporting(our_worker=True))
    return Trial(code, _read_records(folder, plan.nproc), folder, backstop.fired)


class Backstop:
    """Kills the processes this one started when they outlive their own time limit: each rank
    stops itself at the limit (trial.py's timer thread), unless that thread cannot run (a call
    into C that never lets the interpreter switch threads)."""

    def __init__(self, seconds: float):
        self.fired = False
        self._timer = threading.Timer(seconds, self._kill)
        self._timer.daemon = True

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()

    def _kill(self) -> None:
        import psutil

        self.fired = True
        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass


def _read_records(folder: Path, ranks: int) -> list[dict]:
    records = []
    for rank in range(ranks):
        try:
            records.append(json.loads(trial.record_path(folder, rank).read_text()))
        except (OSError, ValueError):
            continue
    return records


@dataclass(frozen=True)
class TrialEnd:
    """How the trial's launch ended: its exit code, its time limit, whether the backstop killed it."""
    code: int
    timeout: float = 0.0
    killed: bool = False


def record_findings(records: list[dict], ranks: int, steps: int, end: TrialEnd, logs: Path,
                    loaders: LoaderFindings | None = None) -> list[Finding]:
    """The findings of the ranks' records (trial.py): one line per check, as doctor prints them."""
    code, timeout, killed = end.code, end.timeout, end.killed
    stopped = [r for r in records if "stopped_at" in r]
    errors = [r for r in records if r.get("error")]
    timed = [r for r in records if "timed_out" in r]
    if errors:
        found = _error_findings(errors, steps, logs)
    elif timed or killed:
        found = [_timeout_finding(records, timed, ranks, steps, timeout, killed)]
    elif len(stopped) < ranks and code != 0:
        found = [Finding("fail", "script run", f"the script failed before its optimizer step {steps} "
                                               f"(exit status {code}); the launcher's report is above, "
                                               f"the logs of every rank in {logs}")]
    elif len(stopped) < ranks:
        done = min((r["steps"] for r in records), default=0)
        found = [Finding("warn", "script run", f"the script ended after {done} optimizer step(s), "
                                               f"before step {steps}: it ran to its end, and what "
                                               "a step shows was not checked (torch.optim steps only)")]
    else:
        at = max(r["stopped_at"] for r in stopped)
        seconds = max(r["seconds"] for r in stopped)
        found = [Finding("ok", "script run", f"ran on {ranks} rank{'s' if ranks > 1 else ''} up to "
                                             f"optimizer step {at} ({seconds:.1f} s), then stopped "
                                             "it: nothing after that step ran")]
    if not records:
        return found
    if any(r["steps"] for r in records):  # judged at an optimizer's first step
        found.append(_unused_finding(records))
    if ranks > 1:
        found += (loaders or _loader_findings)(records, ranks)
    found += [f for f in (_batch_finding(records, ranks), _memory_finding(records),
                          step_estimate(records, ranks)) if f]
    return found


def step_estimate(records: list[dict], ranks: int) -> Finding | None:
    """The time a step (from the second on: the first is the start-up's), and an epoch where the
    training DataLoader's length is known, from rank 0's steps; None with fewer than 3 steps."""
    from multigpu.train.estimate import Estimate, spread

    samples = step_samples(records)
    if not samples:
        return None
    first = next((r for r in records if r["rank"] == 0), records[0])
    batches = next((ld["batches"] for ld in first["loaders"] if ld.get("batches")), None)
    cuda = bool(first.get("memory", {}).get("gpus"))
    estimate = Estimate(sum(samples) / len(samples), spread(samples), len(samples), ranks, cuda,
                        batches=batches, leaves_out=("start-up", "the first step",
                                                     "evaluation and checkpoints (the script's own)"))
    return Finding("ok", "estimate", estimate.line())


def step_samples(records: list[dict]) -> list[float]:
    """Rank 0's seconds of each step from the second on (the first is the start-up's); [] with
    fewer than 3 steps."""
    if not records:
        return []
    first = next((r for r in records if r["rank"] == 0), records[0])
    times = first.get("step_times") or []
    return [b - a for a, b in zip(times, times[1:])] if len(times) >= 3 else []


def _timeout_finding(records: list[dict], timed: list[dict], ranks: int, steps: int,
                     timeout: float, killed: bool) -> Finding:
    """A warn, not a fail: a script without a torch.optim step, or a slow one, is no bug."""
    reached = {r["rank"] for r in records if "stopped_at" in r}
    late = [r for r in range(ranks) if r not in reached]
    who = ("no rank reached" if len(late) == ranks else
           f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not reach")
    done = max((r["steps"] for r in records), default=0)
    if killed:
        how, cause = "killed every rank", ("a rank could not stop itself: it was in a call that "
                                           "lets no other thread run (a C extension, a regular "
                                           "expression backtracking); its logs are named above")
    elif done:
        how, cause = "stopped every rank there", (f"{done} optimizer step(s) ran, slower than that: "
                                                  "raise --trial-timeout or lower --steps")
    else:
        how, cause = "stopped every rank there", (
            "likely causes: the script updates its weights without a torch.optim optimizer (e.g. "
            "p.data -= lr * p.grad) or only evaluates, and doctor can only watch torch.optim "
            "steps; or its first step is slow (data loading, a download, compilation): raise "
            "--trial-timeout")
    where = next((r["where"] for r in sorted(timed, key=lambda r: r["rank"]) if r.get("where")), None)
    return Finding("warn", "script run", f"{who} optimizer step {steps} within --trial-timeout "
                                         f"{timeout:g} s; doctor {how}: {cause}", where=where)


def _error_findings(errors: list[dict], steps: int, logs: Path) -> list[Finding]:
    by_text: dict[tuple, list[int]] = {}
    for r in errors:
        by_text.setdefault((r["error"], r.get("error_where")), []).append(r["rank"])
    found = []
    for (text, where), ranks in by_text.items():
        who = (f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, sorted(ranks)))}"
               if len(ranks) < 5 else f"{len(ranks)} ranks")
        found.append(Finding("fail", "script run", f"{who} failed before optimizer step {steps}: "
                                                   f"{text}", where=where))
    return found


def _unused_finding(records: list[dict]) -> Finding:
    unused = list(dict.fromkeys(n for r in records for n in r["unused"]))
    if not unused:
        return Finding("ok", "unused params", "every trainable parameter of the optimizer got a "
                                              "gradient in its first step", trap=6)
    modules = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in unused if "." in n))
    shown = ", ".join(unused[:6]) + (f" (+{len(unused) - 6} more)" if len(unused) > 6 else "")
    of = f" (module {', '.join(modules[:4])})" if modules else ""
    if any(r["unused_fatal"] for r in records):
        return Finding("fail", "unused params", f"{len(unused)} parameter(s) got no gradient in the "
                                                f"first step: {shown}{of}; DDP stops at the next "
                                                f"forward: {_FIX_UNUSED}", trap=6)
    return Finding("warn", "unused params", f"{len(unused)} parameter(s) got no gradient in the first "
                                            f"step: {shown}{of}; they never train: {_FIX_UNUSED}", trap=6)


def _loader_findings(records: list[dict], ranks: int) -> list[Finding]:
    """The training DataLoaders (iterated with gradients on) of rank 0, or of the first record."""
    first = next((r for r in records if r["rank"] == 0), records[0])
    found = []
    for ld in first["loaders"]:
        where = ld["where"]
        if ld["sharded"] is None:
            found.append(Finding("ok", "sampler", "an IterableDataset: the trial cannot tell whether "
                                                  "each rank reads its own part", where=where))
        elif ld["sharded"]:
            found.append(Finding("ok", "sampler", f"the DataLoader is sharded ({ld['sampler']}): "
                                                  f"{ld['batches']} batches per rank", where=where))
        else:
            # a script with no process group (a one-device script): --auto needs no edit
            auto = ("" if ld.get("distributed", True) else "`multigpu run --auto` (the script "
                    "forms no process group: --auto makes it data-parallel unmodified), or ")
            found.append(Finding("warn", "sampler", f"the DataLoader has no DistributedSampler "
                                                    f"({ld['sampler']}): each of the {ranks} ranks "
                                                    f"goes through all {ld['samples']} samples "
                                                    f"({ld['batches']} batches), repeating the "
                                                    f"others' work; fix: {auto}DataLoader(ds, "
                                                    "sampler=DistributedSampler(ds)) and sampler."
                                                    "set_epoch(epoch) each epoch, or multigpu's "
                                                    "rt.prepare(loader)", where=where))
    return found


def _batch_finding(records: list[dict], ranks: int) -> Finding | None:
    sizes = {r["rank"]: r["batch"] for r in records if r.get("batch") is not None}
    if not sizes:
        return None
    if len(set(sizes.values())) == 1:
        size = next(iter(sizes.values()))
        return Finding("ok", "batch", f"{size} samples per rank in the model's first forward"
                                      f"{_batch_total(records, size, ranks)}")
    each = ", ".join(f"rank {r}: {s}" for r, s in sorted(sizes.items()))
    return Finding("ok", "batch", f"samples per rank in the model's first forward: {each}")


def _batch_total(records: list[dict], size: int, ranks: int) -> str:
    """The global batch, said only where the ranks' batches are shares of the data: a training
    DataLoader of rank 0's is sharded. With none, every rank reads all of the data."""
    first = next((r for r in records if r["rank"] == 0), records[0])
    sharded = [ld["sharded"] for ld in first["loaders"]]
    if ranks == 1 or (None in sharded and True not in sharded):  # an IterableDataset: unknown
        return ""
    if True in sharded:
        return f"; {size * ranks} over the {ranks} ranks"
    return f", the whole data on each of the {ranks} ranks: no DataLoader read for training was split"


def _memory_finding(records: list[dict]) -> Finding | None:
    gpus = [(r["rank"], d, peak, total) for r in records for d, (peak, total)
            in (r["memory"].get("gpus") or {}).items()]
    if gpus:
        each = ", ".join(f"rank {r} {peak / GIB:.2f} of {total / GIB:.0f} GiB on GPU {d}"
                         for r, d, peak, total in sorted(gpus))
        return Finding("ok", "memory", f"peak GPU memory allocated by then: {each}", trap=2)
    host = [r["memory"]["host"] for r in records if r["memory"].get("host")]
    if not host:
        return None
    return Finding("ok", "memory", f"CPU processes: peak host memory {max(host) / GIB:.2f} GiB per "
                                   "process at most (no GPU memory)", trap=2)


# --- what the script wrote ------------------------------------------------------------------------

def snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple[int, int]] | None:
    """path (relative to root) -> (mtime_ns, size) of every file under root but `skip` (the
    trial's own folder); None when there are more than SNAPSHOT_LIMIT (a home folder): then side
    effects are not listed."""
    files = {}
    skip = os.path.realpath(skip) if skip is not None else None
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS
                   and os.path.realpath(os.path.join(folder, d)) != skip]
        for name in names:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            files[os.path.relpath(path, root)] = (st.st_mtime_ns, st.st_size)
            if len(files) > SNAPSHOT_LIMIT:
                return None
    return files


def side_effect_finding(before: dict | None, after: dict | None, root: Path) -> Finding:
    if before is None or after is None:
        return Finding("ok", "side effects", f"not listed: more than {SNAPSHOT_LIMIT} files under "
                                             f"{root}; the script wrote what it writes before its "
                                             "first step(s)")
    new = sorted(p for p in after if p not in before)
    changed = sorted(p for p in after if p in before and after[p] != before[p])
    if not new and not changed:
        return Finding("ok", "side effects", f"the script wrote nothing under {root} before it "
                                             "was stopped")
    parts = []
    if new:
        parts.append(f"new: {_tops(new)}")
    if changed:
        parts.append(f"changed: {_tops(changed)}")
    return Finding("warn" if changed else "ok", "side effects",
                   f"files the script wrote under {root} before it was stopped ({'; '.join(parts)}) "
                   "are left as they are")


def _tops(paths: list[str]) -> str:
    """The top-level names of `paths`, a folder with its count: 'runs/ (3 files), log.txt'."""
    counts: dict[str, int] = {}
    for p in paths:
        head, sep, _ = p.partition(os.sep)
        key = head + "/" if sep else head
        counts[key] = counts.get(key, 0) + 1
    shown = [f"{k} ({n} files)" if k.endswith("/") and n > 1 else k for k, n in counts.items()]
    return ", ".join(shown[:6]) + (f" (+{len(shown) - 6} more)" if len(shown) > 6 else "")
