"""What a lost device costs a `multigpu train --max-restarts 1 --min-devices 2` run, on CPU processes.

    PYTHONPATH=src python benchmarks/lost_device_recovery.py [--runs 3] [--json FILE]

Each run: 3 CPU processes at --global-batch-size 24; after the first checkpoint rank 1 is killed
with -9, and a --device-health script names cpu:1 once that process is gone; the launcher drops
cpu:1 and goes on on 2 processes. The figures are the launcher's own closing line (lost_devices):
the time from the failure (the death seen by the launcher) to the resumed run's first optimizer
step, and the steps trained twice. The median of the runs is printed with every run's line.
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ARGS = ["--model", "mlp", "--data", "synthetic:610", "--epochs", "2", "--global-batch-size", "24",
        "--batch-size", "4", "--optimizer", "sgd", "--lr", "0.05", "--workers", "0", "--seed", "4",
        "--checkpoint-every", "10", "--keep", "100", "--deterministic", "--devices", "cpu:3",
        "--max-restarts", "1", "--min-devices", "2"]
HEALTH = '#!/bin/sh\npid=$(cat "{v}" 2>/dev/null) || exit 0\nkill -0 "$pid" 2>/dev/null || echo cpu:1\n'


def one_run(folder: Path) -> dict:
    from multigpu.train.checkpoints.checkpoint_store import CheckpointStore

    victim, script, out = folder / "victim.pid", folder / "health.sh", folder / "run"
    script.write_text(HEALTH.format(v=victim))
    script.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "multigpu", "train", *ARGS, "--out", str(out),
                             "--device-health", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while True:
        try:
            if CheckpointStore(out / "checkpoints").entries():
                break
        except Exception:
            pass
        time.sleep(0.05)
    rank1 = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                 if p.environ().get("RANK") == "1")
    victim.write_text(str(rank1.pid))
    rank1.kill()
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    line = next(ln for ln in stderr.splitlines() if ln.startswith("multigpu: recovery: "))
    m = re.search(r"([\d.]+) s from the failure .*; (\d+) steps? trained twice", line)
    return {"line": line, "seconds": float(m[1]), "steps_twice": int(m[2])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    runs = [one_run(Path(tempfile.mkdtemp())) for _ in range(a.runs)]
    result = {"runs": runs, "median_seconds": statistics.median(r["seconds"] for r in runs),
              "median_steps_twice": statistics.median(r["steps_twice"] for r in runs)}
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
