"""How long does the `multigpu` command take to answer when it has nothing to train?

    python benchmarks/cli_startup.py [--runs 7]

Each command runs `--runs` times in a fresh interpreter (`python -m multigpu ...`, as the installed
`multigpu` script does); the median and the fastest wall time of each are printed, and, with
--json FILE, written there. Run it with PYTHONPATH pointing at the source tree to measure.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

COMMANDS = (
    ("--help",),
    ("train", "--help"),
    ("train", "--model", "mlp", "--epochs", "0"),  # a usage error found before any work
    ("gpus", "--bogus"),                            # an argparse error
    ("run", "--help"),
)


def time_command(argv: tuple[str, ...], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "multigpu", *argv], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs per command (default 7)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures here")
    args = parser.parse_args()
    time_command(("--help",), 1)  # warm the file cache, so the first command is not penalised
    rows = []
    for argv in COMMANDS:
        times = time_command(argv, args.runs)
        rows.append({"command": "multigpu " + " ".join(argv), "median_s": statistics.median(times),
                     "min_s": min(times), "runs": args.runs})
        print(f"{rows[-1]['median_s']:6.3f} s median  {rows[-1]['min_s']:6.3f} s min  "
              f"{rows[-1]['command']}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"python": sys.version.split()[0], "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
