"""A lost device on one real GPU: `multigpu train --max-restarts 1 --min-devices 1` whose rank is
killed with -9 after its first checkpoint, three ways, each run's stderr lines kept:

  named-index: --device-health names cuda:0 once the rank's process is gone: the run must stop in
               one line naming cuda:0 (0 healthy devices left, fewer than --min-devices 1);
  named-uuid:  the same, the script printing the GPU's UUID (nvidia-smi -L);
  nvml:        no --device-health: NVML is the only source; a healthy GPU restarts on cuda:0 and
               the launch's end gives the recovery line.

    python benchmarks/lost_device_gpu.py --out DIR
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
HEALTH = """#!/bin/sh
echo "MULTIGPU_DEVICES=$MULTIGPU_DEVICES" >> "{log}"
pid=$(cat "{victim}" 2>/dev/null) || exit 0
if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then echo {says}; fi
"""
TRAIN = ["--model", "resnet18", "--data", "synthetic:12800", "--batch-size", "64", "--epochs", "2",
         "--checkpoint-every", "20", "--logger", "none", "--devices", "1", "--max-restarts", "1",
         "--min-devices", "1"]


def gpu_uuid() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout
    return out.split()[0]


def one(out: Path, name: str, says: str | None, train: list[str]) -> dict:
    run = out / name
    run.mkdir(parents=True)
    victim = run / "victim.pid"
    extra = []
    if says is not None:
        script = run / "health.sh"
        script.write_text(HEALTH.format(log=run / "health-calls.txt", victim=victim, says=says))
        script.chmod(0o755)
        extra = ["--device-health", str(script)]
    cmd = [sys.executable, "-m", "multigpu", "train", *train, "--out", str(run / "run"), *extra]
    began = time.time()
    proc = subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killed = None
    while time.time() - began < 150 and proc.poll() is None:
        if list((run / "run").glob("checkpoints/step-*.pt")):
            ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if p.environ().get("RANK") == "0" and p.environ().get("LOCAL_RANK") == "0"]
            rank = next((p for p in ranks if "LOCAL_RANK" not in p.parent().environ()), None)
            if rank is None:
                killed = "no rank process: the run trains in the launcher's own process"
                break
            victim.write_text(str(rank.pid))
            rank.kill()
            killed = rank.pid
            break
        time.sleep(0.05)
    try:
        stdout, stderr = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    calls = (run / "health-calls.txt")
    return {"case": name, "says": says, "killed": killed, "exit": proc.returncode,
            "seconds": round(time.time() - began, 1),
            "multigpu_lines": [ln for ln in stderr.splitlines() + stdout.splitlines()
                               if ln.startswith("multigpu:")],
            "health_calls": calls.read_text().splitlines() if calls.exists() else [],
            "stderr_tail": stderr[-1500:]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", help="only these, e.g. named-uuid")
    p.add_argument("--cpu", action="store_true", help="on one CPU process (mlp), the script's own check")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    train = TRAIN
    if not a.cpu:
        cases = (("named-index", "cuda:0"), ("named-uuid", gpu_uuid()), ("nvml", None))
    else:  # a check of this script on a machine without a GPU
        cases = (("named-index", "cpu:0"), ("nvml", None))
        train = [t.replace("resnet18", "mlp") for t in TRAIN]
        train[train.index("--devices") + 1] = "cpu:1"
    cases = [c for c in cases if not a.cases or c[0] in a.cases.split(",")]
    for name, says in cases:
        r = one(out, name, says, train)
        results.append(r)
        print(json.dumps({k: r[k] for k in ("case", "says", "killed", "exit", "seconds")}), flush=True)
        for line in r["multigpu_lines"]:
            print("   ", line, flush=True)
        print("    health script called with:", r["health_calls"], flush=True)
    (out / "lost_device_gpu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
