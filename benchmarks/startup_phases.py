"""Command -> first optimizer step of `multigpu train`, and where it went: the `time:` line's parts.

    python benchmarks/decode_pipeline.py --make /tmp/jpegs --train 12800       # once: the folder
    python benchmarks/startup_phases.py --folder /tmp/jpegs --gpus 1,2 --trials 3 --out /tmp/startup

Each case is one `multigpu train --model resnet50 --epochs 1` (no --compile) on synthetic data and
on the folder, on each GPU count of --gpus, with the head start on and off (MULTIGPU_HEAD_START=1|0:
the worker's imports and listing in a thread while its group forms, or all in line). Cases take
turns, trial by trial, so that a drift of the machine spreads over all of them, after --warmup
runs of each that are not counted (on a fresh machine the first run was the slowest by far);
the median trial is printed. Each case of multigpu has a twin with `--cudnn-benchmark off`
(`-cudnnoff`, run where --cases names it), to compare with the bare plain script, which does not
autotune, and one with its loader workers started at the first step (`-lateworkers`,
MULTIGPU_EARLY_WORKERS=0; by default a fresh run starts them before its model) and one with its
workers at a higher nice value (`-nicedworkers`, benchmarks/niced_workers), also where named.
--bare adds, on one GPU, startup_bare.py --plain and --plain --tuned (one process by itself,
no torchrun, group or DDP: the floor of a one-GPU script), and, on each GPU count, a bare
torchrun script (startup_bare.py: torch, init_process_group, DDP, one step) in the same turns,
the floor that every DDP script pays, and the same script with its workers forked from
torchrun's agent (bare-fork: no second torch import).
The figures come from rank 0's `time:` line (train/rundir/timeline.py): `first_step_s` is the command until
the first optimizer step was done, `starting_s` until training could begin, `parts` the marked parts
(they add up to starting_s), `meanwhile` the parts a thread did beside them. Every trial's line and
figures go to --out/trials.jsonl, the medians to --out/summary.json.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARE = Path(__file__).with_name("startup_bare.py")
BARE_LINE = re.compile(r"bare: group at ([\d.]+) s, first step done at ([\d.]+) s")
LINE = re.compile(r"time: ([\d.]+) s since the command: ([\d.]+) s starting \((.*?)\), (?:first step "
                  r"done at ([\d.]+) s(?: \(([\d.]+) s waiting for data\))?, )?([\d.]+) s training")


def parse_time_line(text: str) -> dict | None:
    """The figures of the last `time:` line in `text` (None when there is none)."""
    lines = [line for line in text.splitlines() if line.startswith("time: ")]
    match = LINE.match(lines[-1]) if lines else None
    if match is None:
        return None
    whole, starting, inner, first, first_wait, training = match.groups()
    marked, _, beside = inner.partition("; meanwhile in a thread: ")
    parts = {name: float(sec) for name, sec in (p.rsplit(" ", 1) for p in marked.split(", "))}
    meanwhile = {}
    for part in filter(None, beside.split(", ")):
        name_sec, _, during = part.partition(" during ")
        name, sec = name_sec.rsplit(" ", 1)
        meanwhile[name] = {"s": float(sec), "during": during.split(" + ") if during else []}
    return {"whole_s": float(whole), "starting_s": float(starting),
            "first_step_s": float(first) if first else None,
            "first_wait_s": float(first_wait) if first_wait else None, "training_s": float(training),
            "parts": parts, "meanwhile": meanwhile, "line": lines[-1]}


def cases(args) -> list[dict]:
    data = [("synthetic", f"synthetic:{args.synthetic}")]
    if args.folder:
        data.append(("folder", f"folder:{args.folder}"))
    heads = {"both": (True, False), "on": (True,), "off": (False,)}[args.head_start]
    runs = [{"name": f"{gpus}gpu-{kind}-head{'on' if head else 'off'}", "gpus": gpus, "data": spec,
             "head_start": head}
            for gpus in args.gpus for kind, spec in data for head in heads]
    # the same without cuDNN's autotuning, against the bare plain script (which has none)
    runs += [{**run, "name": run["name"] + "-cudnnoff", "args": ["--cudnn-benchmark", "off"]} for run in runs]
    # the loader workers started at the first step instead of before the model (trainloop.py)
    late = [{**run, "name": run["name"] + "-lateworkers", "env": {"MULTIGPU_EARLY_WORKERS": "0"}} for run in runs]
    # the loader workers at a higher nice value (benchmarks/niced_workers), the rank's threads first
    niced = str(Path(__file__).resolve().parent / "niced_workers") + os.pathsep + os.environ.get("PYTHONPATH", "")
    runs += late + [{**run, "name": run["name"] + "-nicedworkers", "env": {"PYTHONPATH": niced}} for run in runs]
    bare = [{"name": f"{gpus}gpu-bare{'-fork' if fork else ''}", "gpus": gpus, "bare": True,
             "fork": fork} for gpus in args.gpus for fork in (False, True)]
    bare += [{"name": f"1gpu-bare-{kind}", "gpus": 1, "bare": True, "fork": False, "plain": True,
              "tuned": kind == "tuned"} for gpus in args.gpus if gpus == 1 for kind in ("plain", "tuned")]
    every = runs + (bare if args.bare else [])
    if not args.cases:  # the twins only where named: they would multiply the default's runs
        return [c for c in every if "args" not in c and "env" not in c]
    return [c for c in every if c["name"] in args.cases.split(",")]


def run_bare(case: dict, args) -> dict:
    """startup_bare.py under plain torchrun (or its workers forked from the agent), its clock
    started here, as the process starts."""
    launcher = ([str(BARE), "--plain", *(["--tuned"] if case.get("tuned") else [])] if case.get("plain") else
                [str(BARE), "--fork", str(case["gpus"])] if case["fork"] else
                ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case['gpus']}",
                 str(BARE)])
    argv = [sys.executable, *launcher, "--model", args.model,
            "--batch-size", str(args.batch_size), *(["--image-size", str(args.image_size)]
                                                     if args.image_size else [])]
    began = time.perf_counter()
    env = dict(os.environ, BARE_STARTED_AT=repr(time.time()))
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - began
    match = BARE_LINE.search(done.stdout)
    if done.returncode != 0 or match is None:
        return {**case, "ok": False, "code": done.returncode, "wall_s": wall,
                "tail": (done.stdout + done.stderr)[-1500:]}
    group, first = map(float, match.groups())
    return {**case, "ok": True, "wall_s": wall, "whole_s": wall, "starting_s": group,
            "first_step_s": first, "training_s": 0.0, "parts": {"process group": group},
            "meanwhile": {}, "line": match.group(0)}


def run_case(case: dict, args, work: Path) -> dict:
    if case.get("bare"):
        return run_bare(case, args)
    out = work / f"{case['name']}-{time.time_ns()}"
    argv = [sys.executable, "-m", "multigpu", "train", "--model", args.model, "--data", case["data"],
            "--devices", str(case["gpus"]) if args.accelerator == "cuda" else f"cpu:{case['gpus']}",
            "--epochs", "1", "--batch-size", str(args.batch_size), "--out", str(out),
            *(["--image-size", str(args.image_size)] if args.image_size else []), *case.get("args", ()),
            *args.extra]
    env = dict(os.environ, MULTIGPU_HEAD_START="1" if case["head_start"] else "0", **case.get("env", {}))
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - began
    figures = parse_time_line(done.stdout + done.stderr)
    if done.returncode != 0 or figures is None:
        tail = (done.stdout + done.stderr)[-1500:]
        return {**case, "ok": False, "code": done.returncode, "wall_s": wall, "tail": tail}
    return {**case, "ok": True, "wall_s": wall, **figures}


def summarise(trials: list[dict]) -> list[dict]:
    rows = []
    for name in dict.fromkeys(t["name"] for t in trials):
        good = [t for t in trials if t["name"] == name and t["ok"]]
        if not good:
            rows.append({"name": name, "ok": 0})
            continue
        med = lambda key, good=good: statistics.median(t[key] for t in good if t.get(key) is not None)  # noqa: E731
        names = dict.fromkeys(p for t in good for p in t["parts"])
        beside = dict.fromkeys(p for t in good for p in t["meanwhile"])
        waits = [t["first_wait_s"] for t in good if t.get("first_wait_s") is not None]
        rows.append({"name": name, "ok": len(good), "first_step_s": med("first_step_s"),
                     "first_wait_s": statistics.median(waits) if waits else None,
                     "starting_s": med("starting_s"), "whole_s": med("whole_s"),
                     "first_step_range": [min(t["first_step_s"] for t in good), max(t["first_step_s"] for t in good)],
                     "parts": {p: statistics.median(t["parts"].get(p, 0.0) for t in good) for p in names},
                     "meanwhile": {p: statistics.median(t["meanwhile"][p]["s"] for t in good
                                                        if p in t["meanwhile"]) for p in beside}})
    return rows


def show(row: dict) -> str:
    if not row["ok"]:
        return f"{row['name']:28s} every trial failed (see trials.jsonl)"
    parts = ", ".join(f"{p} {s:.1f}" for p, s in row["parts"].items())
    beside = ", ".join(f"{p} {s:.1f}" for p, s in row["meanwhile"].items())
    lo, hi = row["first_step_range"]
    wait = f", {row['first_wait_s']:.1f} s of it waiting for data" if row.get("first_wait_s") is not None else ""
    return (f"{row['name']:28s} first step {row['first_step_s']:5.1f} s ({lo:.1f}-{hi:.1f}, "
            f"{row['ok']} trials{wait}), starting {row['starting_s']:5.1f}: {parts}"
            + (f"; meanwhile: {beside}" if beside else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", help="a folder made by decode_pipeline.py --make (else synthetic only)")
    p.add_argument("--gpus", default="1,2", help="GPU counts to start, e.g. 1,2,4 (default 1,2)")
    p.add_argument("--accelerator", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: --devices cpu:N instead of N GPUs (a check of this script)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1,
                   help="runs of each case before the trials, not counted (the disk's cache filled)")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, help="the runs' image size (default: the model's)")
    p.add_argument("--head-start", choices=("both", "on", "off"), default="both",
                   help="multigpu's runs with MULTIGPU_HEAD_START=1, =0, or both (default)")
    p.add_argument("--bare", action="store_true",
                   help="also a bare torchrun script (startup_bare.py) on each GPU count")
    p.add_argument("--synthetic", type=int, default=4096, help="samples of the synthetic case")
    p.add_argument("--cases", help="only these cases, by name (e.g. 1gpu-synthetic-headon,1gpu-bare-plain)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    p.add_argument("--out", required=True, help="folder for trials.jsonl and summary.json")
    p.add_argument("extra", nargs="*", help="more `multigpu train` flags, after --")
    args = p.parse_args()
    args.gpus = [int(g) for g in args.gpus.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trials = []
    with tempfile.TemporaryDirectory(prefix="startup-runs-") as work, \
            open(out / "trials.jsonl", "a") as log:
        for _ in range(args.warmup):
            for case in cases(args):
                ran = run_case(case, args, Path(work))
                print(f"warm-up {case['name']}: {'ok' if ran['ok'] else 'FAILED'}", flush=True)
        for trial in range(args.trials):
            for case in cases(args):
                result = {**run_case(case, args, Path(work)), "trial": trial}
                trials.append(result)
                log.write(json.dumps(result) + "\n")
                log.flush()
                said = (f"first step {result['first_step_s']:.1f} s" if result["ok"]
                        else f"FAILED (exit {result['code']})")
                print(f"trial {trial + 1}/{args.trials} {case['name']}: {said}", flush=True)
                if not result["ok"] and trial == 0:  # why, once, where a log is all that comes back
                    print("    " + "\n    ".join(result["tail"].splitlines()[-8:]), flush=True)
    rows = summarise(trials)
    print()
    for row in rows:
        print(show(row))
    (out / "summary.json").write_text(json.dumps(
        {"argv": sys.argv, "python": sys.version.split()[0], "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
