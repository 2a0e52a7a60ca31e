"""The corpus' runs (benchmarks/auto_corpus.py) and each script's verdict, for
`benchmarks/auto_public_scripts.py --corpus` (which starts the runs, through auto_public_runs).

Per script: three one-process runs (`python script.py ARGS`, as published: none of the corpus
takes a seed, so they differ by the script's own unseeded randomness, or not at all where it seeds
itself), then `multigpu run --auto --devices cpu:N script.py ARGS` for each N of --gpus. Every run
in a folder of its own, its data linked there at the path the script reads, the files the script
reads beside it (nanoGPT's configurator.py, its config) copied there.

What a verdict reads (auto_public_record/sitecustomize.py records it in every process):
- the metric: the script's own printed line (Entry.metric), the mean of its last K matches;
  under --auto over every rank's lines (each rank prints for its part of the global batch: the
  mean of the ranks' means, rank 0's own kept beside it as `metric_rank0`);
- every sample once per epoch: the passes over training data (read with grad on, by a loader
  whose sampler, in a one-process run, is not a SequentialSampler), over all ranks: each complete
  pass fetched every index once, as many complete passes as a one-process run has (a pass left
  incomplete, a `next(iter(loader))` peek, is not an epoch);
- files: every file the run wrote in its folder (opened for writing, renamed onto, torch.save),
  by which ranks; each must be written by one rank only, load whole (torch.load for .pt/.pth/
  .ckpt/.tar, PIL for images, non-empty otherwise), and the run must write the files a one-process
  run writes, no more, no fewer (names compared with their digits masked: tensorboard names its
  files by time and pid);
- equal weights: the hash, at exit, of the parameters of each module that ran a forward and of
  each optimizer's, the same on every rank.

Verdicts (issue 38): `right` (exit 0, metric within the one-process runs' range, samples, files
and weights as above, where observable); `refused` (exit 2 with one `multigpu: error:` line, no
traceback, before any optimizer step); `wrong` (anything else; its reasons listed).
"""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import statistics
from pathlib import Path

import auto_corpus as corpus
import auto_public_data as data
import auto_public_runs as runs

# the last line of a traceback (rank 0's, as the launcher shows it), e.g. "RuntimeError: ..."
EXCEPTION = re.compile(r"^(?:\[rank\d+\]: )?((?:[\w.]+(?:Error|Exception|Interrupt)):? .*)$", re.M)
OWN = ("record", "leases", "ranklogs")  # the harness's own folders in a run's folder
# every corpus run: no display (matplotlib's plt.show() is a no-op under Agg); one thread per
# process, so that N processes on the 2 cores do not each start a thread per core
ENV = {"MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}


def plan(names: list[str], scripts: Path, call: Path, counts: list[int],
         ones: int = 3, autos: int = 1) -> list[runs.Job]:
    jobs = []
    for name in names:
        entry = corpus.CORPUS[name]
        script = corpus.script_path(entry, scripts).resolve()
        folder = call / "corpus" / name / "runs"
        mine = [runs.Job(name, script, folder / f"1proc-{i}", 1, "1gpu", None, False)
                for i in range(1, ones + 1)]
        mine += [runs.Job(name, script, folder / (f"auto-{n}" if autos == 1 else f"auto-{n}-{i}"),
                          n, "auto", None, False)
                 for n in counts for i in range(1, autos + 1)]
        for job in mine:
            job.args = list(entry.args)
        jobs += mine
    return jobs


def generate(name: str, call: Path) -> dict:
    """Each data set of the script, once, under `<call>/corpus/<name>/gen/`: {path the script
    reads (relative to its run folder): where it lies}."""
    links = {}
    for i, (layout, rel, train, test) in enumerate(corpus.CORPUS[name].data):
        target = call / "corpus" / name / "gen" / f"{i}-{layout}"
        if layout == "text":
            target = target / Path(rel).name
        data.LAYOUTS[layout](target, train, test)
        links[rel] = target
    return links


def prepare(job: runs.Job, scripts: Path, links: dict) -> None:
    """The run's folder: its data linked where the script looks, the files beside it copied."""
    entry = corpus.CORPUS[job.name]
    job.cwd.mkdir(parents=True, exist_ok=True)
    for pin in entry.beside:
        rel = Path(pin.path).relative_to(Path(entry.pin.path).parent)
        (job.cwd / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(corpus.pin_path(entry, pin, scripts), job.cwd / rel)
    for rel, target in links.items():
        link = Path(os.path.normpath(job.cwd / rel))
        if not link.is_symlink() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(target)


def launcher(argv: list[str]) -> bool:
    """`python -m multigpu run ...`: the launcher, which records too, but runs no script."""
    return argv[1:4] == ["-m", "multigpu", "run"]


def _events(record: Path) -> dict[int, list[dict]]:
    """Each rank's events, the launcher's left out."""
    out = collections.defaultdict(list)
    for f in sorted(record.glob("events-rank*.jsonl")):
        evs = [json.loads(line) for line in f.read_text().splitlines() if line]
        if evs and evs[0]["kind"] == "process" and launcher(evs[0]["argv"]):
            continue
        out[int(f.name.split("-")[1][4:])] += evs
    return out


def written(events: dict, cwd: Path) -> dict[str, list[int]]:
    """Files in the run's folder (its own folders left out) that each rank wrote: a write to a
    file later renamed counts for the name it got."""
    root = os.path.realpath(cwd)
    by = collections.defaultdict(set)
    for rank, evs in events.items():
        pending = {}
        for e in evs:
            if e["kind"] == "write":
                pending[e["path"]] = e["path"]
            elif e["kind"] == "rename" and e["src"] in pending:
                pending.pop(e["src"])
                pending[e["dst"]] = e["dst"]
        for path in pending:
            real = os.path.realpath(path)
            rel = os.path.relpath(real, root)
            if rel.startswith("..") or rel.split(os.sep)[0] in OWN or not os.path.isfile(real):
                continue
            by[rel].add(rank)
    return {rel: sorted(ranks) for rel, ranks in sorted(by.items())}


def whole(path: Path) -> str | None:
    """None when the file loads whole; else why not."""
    try:
        if path.suffix in (".pt", ".pth", ".ckpt", ".tar"):
            import torch

            torch.load(path, map_location="cpu", weights_only=False)
        elif path.suffix.lower() in (".png", ".jpg", ".jpeg"):
            from PIL import Image

            with Image.open(path) as img:
                img.load()
        elif path.stat().st_size == 0:
            return "empty"
    except Exception as e:  # noqa: BLE001 - any failure to load is the finding
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return None


def passes(record: Path) -> list[dict]:
    """Each loader pass read with grad on, over all ranks: fetched, missing, repeated."""
    by = collections.defaultdict(list)
    for f in sorted(record.glob("samples-rank*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r["grad"]:
                by[(r["dataset"], r["pass"])].append(r)
    out = []
    for (dataset, n), recs in sorted(by.items()):
        counts = collections.Counter(i for r in recs for i in r["indices"])
        out.append({"dataset": dataset, "pass": n, "len": recs[0]["len"], "ranks": len(recs),
                    "samplers": sorted({str(r.get("sampler")) for r in recs}),
                    "complete": all(r["complete"] for r in recs),
                    "fetched": sum(counts.values()), "missing": recs[0]["len"] - len(counts),
                    "repeated": sum(counts.values()) - len(counts)})
    return out


def epochs(run: dict, one: dict) -> list[dict]:
    """The run's complete passes over the training data: the data sets a one-process run reads
    through a sampler other than SequentialSampler (--auto swaps the sampler: the one-process
    run says which loaders shuffle)."""
    train = {p["dataset"] for p in one["passes"] if p["samplers"] != ["SequentialSampler"]}
    return [p for p in run["passes"] if p["dataset"] in train and p["complete"]]


def metric(entry: corpus.Entry, text: str) -> float | None:
    found = [float(m) for m in re.findall(entry.metric, text, re.M)]
    if not found:
        return None
    return statistics.fmean(found[-entry.metric_mean_of_last:])


def rank_metrics(entry: corpus.Entry, text: str, ranklogs: Path) -> dict[int, float | None]:
    """Each rank's metric: rank 0's from the run's log (the launcher shows its output), the
    others' from their own stdout.log under ranklogs/ (the last attempt's)."""
    out = {0: metric(entry, text)}
    logs = {}
    for f in sorted(ranklogs.glob("**/attempt_*/*/stdout.log")) if ranklogs.is_dir() else []:
        if f.parent.name.isdigit() and int(f.parent.name) > 0:
            logs[int(f.parent.name)] = f  # sorted: a later attempt's replaces an earlier one's
    for rank, f in sorted(logs.items()):
        out[rank] = metric(entry, f.read_text(errors="replace"))
    return out


def collect(job: runs.Job) -> dict:
    entry = corpus.CORPUS[job.name]
    log = job.cwd.parent / f"{job.cwd.name}.log"
    text = log.read_text(errors="replace")
    others = "".join(p.read_text(errors="replace") for p in sorted(
        (job.cwd / "ranklogs").rglob("*")) if p.is_file()) if (job.cwd / "ranklogs").is_dir() else ""
    events = _events(job.cwd / "record")
    files = written(events, job.cwd)
    exits = {r: next((e for e in evs if e["kind"] == "exit"), None) for r, evs in events.items()}
    by_rank = rank_metrics(entry, text, job.cwd / "ranklogs")
    over_ranks = (None if None in by_rank.values() else statistics.fmean(by_rank.values()))
    return {
        "script": job.name, "run": job.cwd.name, "mode": job.mode, "devices": job.devices,
        "rc": job.rc, "wall_s": job.wall_s, "args": job.args, "metric": over_ranks,
        "metric_rank0": by_rank[0], "rank_metrics": by_rank,
        "files": {rel: {"ranks": ranks, "broken": whole(job.cwd / rel)}
                  for rel, ranks in files.items()},
        "passes": passes(job.cwd / "record"),
        "stepped": sorted(r for r, evs in events.items()
                          if any(e["kind"] == "first_step" for e in evs)),
        "steps": {r: e["steps"] for r, e in exits.items() if e},
        "weights": {r: e["weights"] for r, e in exits.items() if e},
        "error_lines": [ln for ln in text.splitlines() if ln.startswith("multigpu: error:")],
        "notes": [ln for ln in text.splitlines() if ln.startswith("multigpu: note:")],
        "exception": (EXCEPTION.findall(text) or [None])[-1],
        "traceback": "Traceback (most recent call last)" in text + others,
        "last_lines": text.splitlines()[-3:],
        "shims": sorted({e["what"] for evs in events.values() for e in evs
                         if e["kind"] == "shim"}),
        "log": str(log)}


def _names(files: dict) -> list[str]:
    return sorted(re.sub(r"\d+", "#", rel) for rel in files)


def verdict(run: dict, ones: list[dict], base: list | None = None) -> tuple[str, list[str]]:
    """(right | refused | wrong | baseline-failed, the reasons) of a multi-process run; `base`:
    the one-process metrics its metric is held to (the runs' own in `ones` by default)."""
    if any(o["rc"] != 0 for o in ones):
        return "baseline-failed", [f"{o['run']}: exit {o['rc']}: {o['last_lines'][-1:]}"
                                   for o in ones if o["rc"] != 0]
    if run["rc"] != 0:
        if (run["rc"] == 2 and len(run["error_lines"]) == 1 and not run["traceback"]
                and not run["stepped"]):
            return "refused", [run["error_lines"][0]]
        why = run["error_lines"][:1] or (
            [run["exception"]] if run.get("exception") else run["last_lines"][-1:])
        return "wrong", [f"exit {run['rc']}" + (" (timed out)" if run["rc"] in (-9, 137) else "")
                         + (f" after {len(run['stepped'])} rank(s) stepped" if run["stepped"]
                            else "") + f": {why[0] if why else ''}"]
    reasons = []
    base = [o["metric"] for o in ones] if base is None else base
    if run["metric"] is None or None in base:
        reasons.append(f"metric not printed (auto {run['metric']}, one-process {base})")
    elif not min(base) <= run["metric"] <= max(base):
        reasons.append(f"metric {_g(run['metric'])} outside the one-process range "
                       f"[{_g(min(base))}, {_g(max(base))}]")
    mine, theirs = epochs(run, ones[0]), epochs(ones[0], ones[0])
    bad = [e for e in mine if e["missing"] or e["repeated"]]
    if bad:
        first = {k: bad[0][k] for k in ("dataset", "pass", "len", "fetched", "missing",
                                        "repeated")}
        reasons.append(f"samples not once per epoch: {len(bad)} of {len(mine)} epochs, "
                       f"e.g. {first}")
    if len(mine) != len(theirs):
        reasons.append(f"{len(mine)} complete training passes, one process {len(theirs)}")
    reasons += _file_reasons(run, ones[0])
    weights = list(run["weights"].values())
    if len(weights) < run["devices"]:
        reasons.append(f"weights recorded on {len(weights)} of {run['devices']} ranks")
    elif any(w != weights[0] for w in weights):
        first = {tuple(h) for h in weights[0]}
        differ = [h for w in weights[1:] for h in map(tuple, w) if h not in first]
        reasons.append(f"weights differ between ranks: {len(differ)} of {len(first)} hashes, "
                       f"e.g. {differ[0][0]} ({differ[0][1]} values)")
    return ("right" if not reasons else "wrong"), reasons


def _file_reasons(run: dict, one: dict) -> list[str]:
    out = []
    for rel, f in run["files"].items():
        if len(f["ranks"]) > 1:
            out.append(f"{rel} written by ranks {f['ranks']}")
        if f["broken"]:
            out.append(f"{rel} not whole: {f['broken']}")
    mine, theirs = _names(run["files"]), _names(one["files"])
    if mine != theirs:
        extra = sorted((collections.Counter(mine) - collections.Counter(theirs)).elements())
        lost = sorted((collections.Counter(theirs) - collections.Counter(mine)).elements())
        out.append(f"files differ from a one-process run's: extra {extra[:4]}"
                   f"{'...' if len(extra) > 4 else ''}, missing {lost[:4]}")
    return out


def summarise(results: list[dict], baseline: dict | None = None) -> dict:
    """Each script's verdicts. `baseline`: {script: one-process metrics} of an earlier call (the
    same scripts and torch: a one-process run runs no --auto code), the range held to in place of
    this call's own one-process runs, which still give the samples and files checks."""
    out = {}
    for name in dict.fromkeys(r["script"] for r in results):
        mine = [r for r in results if r["script"] == name]
        ones = [r for r in mine if r["mode"] == "1gpu"]
        entry = corpus.CORPUS[name]
        s = out[name] = {"repo": entry.pin.repo, "commit": entry.pin.commit,
                         "path": entry.pin.path, "metric": entry.metric_label,
                         "one_process": [o["metric"] for o in ones]}
        if baseline and name in baseline:
            s["one_process_here"], s["one_process"] = s["one_process"], list(baseline[name])
        for r in (r for r in mine if r["mode"] != "1gpu"):
            v, reasons = verdict(r, ones, s["one_process"])
            s[r["run"]] = {"verdict": v, "reasons": reasons, "metric": r["metric"],
                           "metric_rank0": r.get("metric_rank0"),
                           "rc": r["rc"], "wall_s": r["wall_s"], "notes": r.get("notes", []),
                           "observed": observed(r, ones[0])}
    return out


def observed(run: dict, one: dict) -> list[str]:
    """Which of the checks this script lets us make (issue 38: 'where observable')."""
    out = ["metric"]
    if epochs(one, one):
        out.append("samples")
    if one["files"]:
        out.append("files")
    if any(run["weights"].values()):
        out.append("weights")
    return out


def _g(x):
    return x if x is None else float(f"{x:.6g}")


def table(summary: dict) -> str:
    rows = []
    for name, s in summary.items():
        for run, v in ((k, v) for k, v in s.items() if isinstance(v, dict)):
            rank0 = (f", rank 0's {_g(v['metric_rank0'])}" if v.get("metric_rank0") is not None
                     and v["metric_rank0"] != v["metric"] else "")
            rows.append(f"{name} {run}: {v['verdict']} (metric {_g(v['metric'])}{rank0} vs "
                        f"one-process {[_g(m) for m in s['one_process']]}, exit {v['rc']}, "
                        f"{v['wall_s']} s; checked: "
                        f"{', '.join(v.get('observed', []))})")
            rows += [f"    - {why}" for why in v["reasons"]]
            rows += [f"    - said: {note}" for note in v.get("notes", [])]
    return "\n".join(rows) + "\n"


def save_jobs(jobs: list[runs.Job], call: Path) -> None:
    """What --recollect needs to read the runs again: each run's exit status and time."""
    (call / "jobs.json").write_text(json.dumps(
        [{"name": j.name, "script": str(j.script), "cwd": str(j.cwd), "devices": j.devices,
          "mode": j.mode, "args": j.args, "rc": j.rc, "wall_s": j.wall_s} for j in jobs], indent=1))


def load_jobs(call: Path) -> list[runs.Job]:
    jobs = []
    for d in json.loads((call / "jobs.json").read_text()):
        job = runs.Job(d["name"], Path(d["script"]), Path(d["cwd"]), d["devices"], d["mode"],
                       None, False)
        job.args, job.rc, job.wall_s = d["args"], d["rc"], d["wall_s"]
        jobs.append(job)
    return jobs
