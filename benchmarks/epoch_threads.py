"""Whole `multigpu train` epochs on a JPEG folder in settings that take turns, and where rank 0's
threads and its loader workers spend the second epoch: on a CPU, or runnable and waiting for one.

    python benchmarks/epoch_threads.py --folder DIR --out OUT --rounds 2 \
        --setting default: --setting omp1:OMP_NUM_THREADS=1 --setting w10:--workers=10

A setting is NAME:ITEMS, ITEMS comma-separated, each VAR=VALUE (the run's environment) or
--flag=value (a `multigpu train` flag; a value may hold commas: --logger=tensorboard,csv).
Settings take turns (A B C A B C), so that a drift of the
machine hits each alike. Every run trains ResNet-50 bf16 batch 128 for --epochs epochs, profiles
--window (MULTIGPU_PROFILE_STEPS, in epoch 2), and, --settle seconds into epoch 2, reads
/proc/<tid>/schedstat of every thread of rank 0 and of each loader worker twice, --seconds apart:
per thread, the milliseconds per second it ran and the milliseconds per second it was runnable
but waited for a CPU (the kernel's run-queue delay). The rank's main thread is the thread whose
id is the process's; torch's autograd thread is named pt_autograd_*. One JSON line per run goes
to OUT/runs.jsonl; a table is printed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_setting(text: str) -> tuple[str, dict, list]:
    name, _, items = text.partition(":")
    env, flags = {}, []
    parts: list[str] = []
    for item in filter(None, items.split(",")):  # "--logger=tensorboard,csv": one item
        if parts and not item.startswith("--") and "=" not in item:
            parts[-1] += "," + item
        else:
            parts.append(item)
    for item in parts:
        if item.startswith("--"):
            flag, _, value = item.partition("=")
            flags += [flag, value] if value else [flag]
        else:
            key, _, value = item.partition("=")
            env[key] = value
    return name, env, flags


def threads_of(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (name, ns on a CPU, ns runnable waiting for a CPU) of each thread of `pid`."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            run, wait, _ = (int(v) for v in (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue
        found[int(task.name)] = (name, run, wait)
    return found


def rank_process(launcher: psutil.Process) -> psutil.Process:
    for p in launcher.children(recursive=True):
        try:
            if "LOCAL_RANK" in p.environ() and "LOCAL_RANK" not in p.parent().environ():
                return p
        except psutil.Error:
            pass
    return launcher  # one process: the launcher trains in its own process


def sample(rank: psutil.Process, seconds: float) -> dict:
    """Per thread of the rank, and summed over its workers: ms a second on a CPU and waiting."""
    workers = [c.pid for c in rank.children()]
    before = {pid: threads_of(pid) for pid in [rank.pid, *workers]}
    time.sleep(seconds)
    after = {pid: threads_of(pid) for pid in before}

    def rate(pid, tid):
        name, run, wait = after[pid][tid]
        _, run0, wait0 = before[pid].get(tid, (name, 0, 0))
        return name, (run - run0) / 1e6 / seconds, (wait - wait0) / 1e6 / seconds

    threads = []
    for tid in after[rank.pid]:
        name, run, wait = rate(rank.pid, tid)
        if run > 1 or wait > 1:
            threads.append({"tid": tid, "main": tid == rank.pid, "name": name,
                            "run_ms_per_s": round(run, 1), "wait_ms_per_s": round(wait, 1)})
    threads.sort(key=lambda t: -t["run_ms_per_s"])
    w_run = w_wait = 0.0
    for pid in workers:
        for tid in after[pid]:
            _, run, wait = rate(pid, tid)
            w_run, w_wait = w_run + run, w_wait + wait
    return {"threads": threads, "workers": len(workers), "workers_run_ms_per_s": round(w_run, 1),
            "workers_wait_ms_per_s": round(w_wait, 1), "cpus": os.cpu_count()}


def one_run(a, name: str, env: dict, flags: list, turn: int) -> dict:
    run = Path(a.out) / f"{name}-{turn}"
    cmd = [sys.executable, "-m", "multigpu", "train", "--model", a.model, "--data", f"folder:{a.folder}",
           "--batch-size", str(a.batch_size), "--epochs", str(a.epochs), "--precision", a.precision,
           "--devices", a.devices,
           "--logger", "none", "--checkpoint-every", "0", "--log-every", "20", "--out", str(run), *flags]
    full_env = {**os.environ, **ENV, "MULTIGPU_PROFILE_STEPS": a.window, **env}
    log_path = run.with_suffix(".log")
    began = time.time()
    with open(log_path, "w") as log:
        launcher = psutil.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        threads = None
        while launcher.poll() is None and time.time() - began < a.timeout:
            if threads is None and "epoch 1 " in log_path.read_text():
                time.sleep(a.settle)
                rank = rank_process(launcher)
                threads = sample(rank, a.seconds) if rank else {"error": "no rank found"}
            time.sleep(0.2)
        if launcher.poll() is None:
            launcher.kill()
        code = launcher.wait()
    decode = [line for line in log_path.read_text().splitlines() if "kept for the run" in line
              or "(the rule) kept" in line]  # --decode auto's trial, or why it did not run
    metrics = run / "metrics.jsonl"
    epochs = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    profile = [json.loads(p.read_text()) for p in sorted((run / "profile").glob("rank*.json"))]
    for p in list((run / "checkpoints").glob("*/*")) + list((run / "profile").glob("trace-*.json")):
        p.unlink()
    return {"setting": name, "turn": turn, "env": env, "flags": flags, "exit": code, "decode": decode,
            "wall_s": round(time.time() - began, 1),
            "epochs": [{k: e.get(k) for k in ("epoch", "samples_per_second", "input_wait", "epoch_seconds")}
                       for e in epochs], "profile": profile, "threads": threads}


def show(r: dict) -> str:
    eps = ", ".join(f"e{e['epoch']} {e['samples_per_second']:.0f} ({e['input_wait']:.0%} wait)" for e in r["epochs"])
    line = f"{r['setting']:12s} turn {r['turn']} exit {r['exit']}: {eps}"
    for p in r["profile"]:
        line += (f"\n    profile: step {p['step_ms']:.1f} ms, GPU busy {p['gpu_busy_ms']:.1f}, idle "
                 f"{p['gpu_idle_ms']:.1f}, waiting {p['waiting_for_data_ms']:.1f}")
    t = r["threads"] or {}
    if "threads" in t:
        top = ", ".join(f"{x['name']}{'(main)' if x['main'] else ''} {x['run_ms_per_s']:.0f}/{x['wait_ms_per_s']:.0f}"
                        for x in t["threads"][:6])
        line += (f"\n    threads ran/waited ms per s: {top}; {t['workers']} workers {t['workers_run_ms_per_s']:.0f}"
                 f"/{t['workers_wait_ms_per_s']:.0f}")
    return line


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--setting", action="append", required=True, help="NAME:ITEMS (module docstring)")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--devices", default="1")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--window", default="300-319")
    p.add_argument("--settle", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--timeout", type=float, default=150.0)
    a = p.parse_args()
    if Path(a.out).exists() and any(Path(a.out).iterdir()):  # an earlier run's figures would be read as this one's
        raise SystemExit(f"--out {a.out} holds earlier runs: give a new folder")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    settings = [parse_setting(s) for s in a.setting]
    results = []
    with open(Path(a.out) / "runs.jsonl", "a") as out:
        for turn in range(1, a.rounds + 1):
            for name, env, flags in settings:
                r = one_run(a, name, env, flags, turn)
                results.append(r)
                out.write(json.dumps(r) + "\n")
                out.flush()
                print(show(r), flush=True)
    print("\nmedians of the last epoch's img/s:")
    for name, _, _ in settings:
        rates = [r["epochs"][-1]["samples_per_second"] for r in results if r["setting"] == name and r["epochs"]]
        if rates:
            print(f"  {name:12s} {statistics.median(rates):7.0f}  ({', '.join(f'{x:.0f}' for x in rates)})")


if __name__ == "__main__":
    main()
