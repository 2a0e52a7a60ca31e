"""What a scheduler's requeue costs a `multigpu train --out R --resume R` job, on CPU processes.

    PYTHONPATH=src python benchmarks/requeue_recovery.py [--kills 2] [--devices cpu:2] [--json FILE]

The job's one command is started; once a checkpoint newer than the last appears, a random
0-1.5 s later, the launcher and all its workers are killed with -9 (a node's end, or a
scheduler's grace period over) and the same command is started again at once; after `--kills`
kills it runs to the end. For each kill it prints the recovery time, from the kill to the
resumed run's first optimizer step (the resumed run's own `time:` line: start-up, resume, first
step), and the steps trained twice, estimated as the seconds between the newest checkpoint and
the kill times the run's steps per second (its epochs' rate), at most --checkpoint-every (40).
"""
import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ARGS = ["--model", "mlp", "--data", "synthetic:6000", "--epochs", "3", "--batch-size", "16",
        "--optimizer", "sgd", "--lr", "0.05", "--workers", "0", "--seed", "4",
        "--checkpoint-every", "40", "--deterministic"]


def newest_step(out: Path) -> int:
    from multigpu.train.checkpoints.checkpoint_store import CheckpointStore

    try:
        entries = CheckpointStore(out / "checkpoints").entries()
    except Exception:  # mid-rename, or no folder yet
        return -1
    return entries[-1].global_step if entries else -1


def kill_all(proc: subprocess.Popen) -> None:
    everyone = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in everyone:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(everyone, timeout=30)
    proc.communicate(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--devices", default="cpu:2")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rng = random.Random(11)
    out = Path(tempfile.mkdtemp()) / "job"
    command = [sys.executable, "-m", "multigpu", "train", *ARGS, "--devices", a.devices,
               "--out", str(out), "--resume", str(out)]
    kills = []
    for _ in range(a.kills):
        before = newest_step(out)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while (step := newest_step(out)) <= before:
            time.sleep(0.02)
        saved_at, kill_at = time.monotonic(), time.monotonic() + rng.uniform(0.0, 1.5)
        while time.monotonic() < kill_at:  # a newer checkpoint meanwhile: the time from it
            if (now := newest_step(out)) > step:
                step, saved_at = now, time.monotonic()
            time.sleep(0.02)
        killed = time.monotonic()
        kill_all(proc)
        kills.append({"checkpoint_step": newest_step(out), "seconds_after_checkpoint": killed - saved_at})
    last = subprocess.run(command, capture_output=True, text=True)
    assert last.returncode == 0, last.stderr[-2000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_per_s = statistics.median(r["samples_per_second"] for r in records) / (16 * int(a.devices.split(":")[-1]))
    firsts = [float(m) for m in re.findall(r"first step done at ([\d.]+) s", last.stdout + last.stderr)]
    # each relaunch but the last was killed: its first step is in its own output, lost with it;
    # the recovery of the last kill is the last relaunch's, measured in full here
    result = {"devices": a.devices, "kills": kills, "steps_per_second": steps_per_s,
              "steps_trained_twice": [round(k["seconds_after_checkpoint"] * steps_per_s) for k in kills],
              "last_recovery_first_step_s": firsts[-1] if firsts else None,
              "epochs": [r["epoch"] for r in records]}
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
