"""A storm of Ctrl-Cs during start-up: does every one stop the run? (issue 40, item 3)

    python benchmarks/ctrl_c_storm.py SRC [SRC ...] --tries 20 --load 2

Each try starts `multigpu train --model mlp --data digits --devices cpu:2 --epochs 1` from a source
tree in a session of its own (SIGINT restored to its default: a shell that runs this in the
background ignores it for its children), and sends SIGINT to the whole process group at a random
moment of --window seconds, as a terminal's Ctrl-C does. A try is right when the command exits
130 with one line on stderr after the signal, no traceback, and no run folder left (the ranks'
logs, kept beside it, are shown for a try that went wrong). Trees are run in turns (the
same moments for each), so that they meet the same load; --load N keeps N busy processes running
meanwhile, the load of a shared machine.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

TRAIN = ["-m", "multigpu", "train", "--model", "mlp", "--data", "digits", "--devices", "cpu:2",
         "--epochs", "1", "--logger", "none"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _read_lines(stream, into: list) -> None:
    """Each line of `stream` with the moment it came (time.monotonic())."""
    for line in stream:
        into.append((time.monotonic(), line.rstrip("\n")))


def _rank_tails(log_dir: str) -> str:
    """The last lines of each other rank's stderr log (its output is not on the console)."""
    tails = []
    for path in sorted(glob.glob(os.path.join(log_dir, "**", "stderr.log"), recursive=True)):
        with open(path, errors="replace") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        tails.append(f"{os.path.relpath(path, log_dir)}: {lines[-3:]}")
    return "; ".join(tails)


def one_try(src: str, python: str, out: str, delay: float, timeout: float) -> tuple[str, str]:
    """(verdict, what was said after the signal) of one Ctrl-C `delay` s into the command.
    Only the lines that came after the signal count: the launcher's header before it is not the
    Ctrl-C's answer. The ranks' logs go beside the run folder, to be read when a try went wrong."""
    env = {**os.environ, "PYTHONPATH": src}
    env.pop("MULTIGPU_DEBUG", None)
    log_dir = out + "-logs"
    proc = subprocess.Popen([python, *TRAIN, "--out", out, "--log-dir", log_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=_default_sigint)
    said: list[tuple[float, str]] = []
    printed: list[tuple[float, str]] = []
    readers = [threading.Thread(target=_read_lines, args=(stream, lines), daemon=True)
               for stream, lines in ((proc.stderr, said), (proc.stdout, printed))]
    for reader in readers:
        reader.start()
    time.sleep(delay)
    sent = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for reader in readers:
        reader.join()
    took = time.monotonic() - sent
    after = [line for at, line in said if at >= sent and line.strip()]
    left = os.path.exists(out)
    shown = " | ".join(after[-3:]) + f" ({took:.1f} s after the signal)"
    if proc.returncode != 130 and os.path.isdir(log_dir):
        shown += "; ranks: " + _rank_tails(log_dir)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(log_dir, ignore_errors=True)
    if took > timeout:
        verdict = "hung"
    elif proc.returncode == 0 and any("had finished before the signal" in line for _, line in printed):
        verdict = "finished before the signal (exit 0, said)"  # as designed: not a lost Ctrl-C
    elif proc.returncode == 0:
        verdict = "lost (trained to exit 0)"
    elif any("Traceback" in line for _, line in said):
        verdict = f"traceback (exit {proc.returncode})"
    elif proc.returncode != 130:
        verdict = f"exit {proc.returncode}"
    elif len(after) != 1:
        verdict = f"{len(after)} lines"
    elif left:
        verdict = "folder left"
    else:
        verdict = "right"
    return verdict, shown


def _busy() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sources", nargs="+", help="src/ folders to compare, in turns")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--tries", type=int, default=20, help="Ctrl-Cs per source tree")
    p.add_argument("--window", type=float, nargs=2, default=(0.6, 3.0), metavar=("FROM", "TO"))
    p.add_argument("--load", type=int, default=0, help="busy processes kept running meanwhile")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=120.0, help="s a try may take after the signal")
    args = p.parse_args()
    rng = random.Random(args.seed)
    counts = {src: Counter() for src in args.sources}
    busy = [_busy() for _ in range(args.load)]
    began = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for n in range(args.tries):
                delay = rng.uniform(*args.window)
                for i, src in enumerate(args.sources):
                    verdict, said = one_try(src, args.python, os.path.join(scratch, f"run{n}-{i}"),
                                            delay, args.timeout)
                    counts[src][verdict] += 1
                    shown = "" if verdict == "right" else f": {said}"
                    print(f"try {n + 1} at {delay:.2f} s, {src}: {verdict}{shown}", flush=True)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    for src, count in counts.items():
        print(f"{src}: {count['right']} of {sum(count.values())} right; "
              + ", ".join(f"{v}: {c}" for v, c in count.most_common() if v != "right"))
    print(f"{time.monotonic() - began:.0f} s, load {args.load}, window {args.window[0]}-{args.window[1]} s")
    fine = ("right", "finished before the signal (exit 0, said)")
    return 0 if all(sum(c[v] for v in fine) == sum(c.values()) for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
