"""How long `multigpu train` takes after its `time:` line, and how short that line is of the
command's wall time: the tail a user waits through after the summary (issue 40, item 8).

    python benchmarks/exit_tail.py SRC [SRC ...] --turns 3

Runs `multigpu train --model mlp --data digits --epochs 1 --devices cpu:2 --logger none` from each
source tree in turns (trees compared within one call only: machines differ) and prints, per run,
when the `time:` line came, what it said and when the command ended.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def one_run(src: str, out: str) -> tuple[float, float, float]:
    """(seconds to the time: line, the seconds it says, seconds to the command's end)."""
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, "-m", "multigpu", "train", "--model", "mlp", "--data", "digits",
           "--epochs", "1", "--devices", "cpu:2", "--logger", "none", "--out", out]
    began = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    seen = said = float("nan")
    for line in proc.stdout:
        if line.startswith("time:"):
            seen, said = time.monotonic() - began, float(line.split()[1])
    proc.wait()
    return seen, said, time.monotonic() - began


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sources", nargs="+", help="src/ folders to compare")
    p.add_argument("--turns", type=int, default=3)
    args = p.parse_args()
    tails: dict[str, list[float]] = {s: [] for s in args.sources}
    with tempfile.TemporaryDirectory() as scratch:
        for turn in range(args.turns):
            for i, src in enumerate(args.sources):
                seen, said, end = one_run(src, os.path.join(scratch, f"run{turn}-{i}"))
                tails[src].append(end - seen)
                print(f"{src}: time: line at {seen:.2f} s saying {said:.1f} s, ended at {end:.2f} s "
                      f"(tail {end - seen:.2f} s, the line {end - said:.2f} s short)", flush=True)
    for src, values in tails.items():
        print(f"{src}: median tail {statistics.median(values):.2f} s over {len(values)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
