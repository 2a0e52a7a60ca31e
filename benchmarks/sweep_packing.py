"""Post 002's 18-run sweep (examples/sweep_post002.yaml), timed packed against a baseline, in turns.

Each variant is the wall time of one `multigpu sweep` command into a fresh folder; the variants
alternate (A B A B ...) so that a change in the machine's load hits both. It also checks that
every run's final metrics are the same in both variants.

    # CPU, against a worktree of the commit before (git worktree add /tmp/main-before <commit>):
    python benchmarks/sweep_packing.py --cpu --before-src /tmp/main-before/src --turns 3 \
        --json benchmarks/results/<date>-sweep-post002-cpu-packing/dev-2cores.json
    # GPUs (all of the machine's), this tree only: exec'd runs one a GPU (as before packing:
    # MULTIGPU_SWEEP_COLD_START=1 --runs-per-gpu 1) against the default (warm, K from the memory)
    python benchmarks/sweep_packing.py --turns 2 --json /tmp/gpu-packing.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "examples" / "sweep_post002.yaml"


def variants(args) -> dict[str, tuple[str, list[str], dict]]:
    """name -> (PYTHONPATH src, extra sweep flags, extra environment)."""
    here = str(REPO / "src")
    if args.cpu:
        per_run = ["--devices-per-run", "cpu:1"]
        return {"before": (args.before_src or here, per_run, {"MULTIGPU_SWEEP_COLD_START": "1"}),
                "after": (here, per_run, {})}
    return {"before": (args.before_src or here, ["--runs-per-gpu", "1"], {"MULTIGPU_SWEEP_COLD_START": "1"}),
            "after": (here, [], {})}


def run_once(src: str, flags: list[str], extra_env: dict, out: Path) -> float:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1", **extra_env,
           "MULTIGPU_LEASE_DIR": str(out.parent / "leases"),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "multigpu", "sweep", *flags, "--out", str(out),
                           str(SWEEP)], env=env, capture_output=True, text=True)
    took = time.perf_counter() - began
    if proc.returncode != 0:
        sys.exit(f"sweep failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return took


def final_metrics(out: Path) -> dict[str, dict]:
    result = {}
    for run in sorted((out / "runs").iterdir()):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        last = json.loads(lines[-1])
        result[run.name] = {k: last[k] for k in ("train_loss", "val_loss", "val_mae", "val_rmse")}
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="runs on CPU cores (cpu:1 a run)")
    p.add_argument("--before-src", help="the baseline's src folder (default: this tree, cold start)")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sweep-packing-"))
    times: dict[str, list[float]] = {name: [] for name in variants(args)}
    metrics: dict[str, dict] = {}
    load = [os.getloadavg()[0]]
    for turn in range(args.turns):
        for name, (src, flags, extra) in variants(args).items():
            out = work / f"{name}-{turn}"
            took = run_once(src, flags, extra, out)
            times[name].append(round(took, 1))
            metrics.setdefault(name, final_metrics(out))
            load.append(os.getloadavg()[0])
            print(f"turn {turn + 1} {name}: {took:.1f} s (load {load[-1]:.2f})", flush=True)
            shutil.rmtree(out)
    median = {k: sorted(v)[len(v) // 2] if len(v) % 2 else sum(sorted(v)[len(v) // 2 - 1:len(v) // 2 + 1]) / 2
              for k, v in times.items()}
    same = metrics["before"] == metrics["after"]
    report = {"times_s": times, "median_s": median, "ratio": round(median["after"] / median["before"], 3),
              "final_metrics_identical": same, "load_1min": [round(x, 2) for x in load],
              "cores": len(os.sched_getaffinity(0)), "python": sys.version.split()[0],
              "variants": {k: {"src": v[0], "flags": v[1], "env": v[2]} for k, v in variants(args).items()}}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
