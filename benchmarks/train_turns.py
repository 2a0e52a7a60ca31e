"""Whole `multigpu train` runs of two (or more) source trees on a folder of JPEGs, in turns.

    python benchmarks/train_turns.py --folder DIR --tree before=/tmp/before/src --tree after=src \
        --turns 2 --decode cpu --out OUT [--devices 0,1,2,3]

Each run trains ResNet-50 (bf16, batch 128 a GPU) for 2 epochs with PYTHONPATH set to its tree and
profiles --window of the second epoch (MULTIGPU_PROFILE_STEPS). The trees take turns (A B A B), so
that a drift of the machine hits both. Prints, per run, the second epoch's img/s and waiting share
and each rank's profile; then each tree's median; writes OUT/turns.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def one_run(a, name: str, tree: str, turn: int) -> dict:
    run = Path(a.out) / f"{name}-{turn}"
    extra = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, **ENV, "MULTIGPU_PROFILE_STEPS": a.window,
           "PYTHONPATH": str(Path(tree).resolve()) + (os.pathsep + extra if extra else "")}
    cmd = [sys.executable, "-m", "multigpu", "train", "--model", a.model, "--data", f"folder:{a.folder}",
           "--batch-size", str(a.batch_size), "--epochs", "2", "--precision", a.precision,
           "--devices", a.devices, "--logger", "none", "--checkpoint-every", "0", "--decode", a.decode,
           "--out", str(run), *a.extra]
    with open(run.with_suffix(".log"), "w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
    metrics = run / "metrics.jsonl"
    epochs = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    ranks = [json.loads(p.read_text()) for p in sorted((run / "profile").glob("rank*.json"))]
    for p in (run / "checkpoints").glob("*/*"):
        p.unlink()  # large, and not what is measured
    last = epochs[-1] if epochs else {}
    return {"tree": name, "turn": turn, "exit": code, "img_per_s": last.get("samples_per_second"),
            "input_wait": last.get("input_wait"), "profile": ranks}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--tree", action="append", required=True, help="NAME=SRC (a tree's src folder)")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--decode", default="cpu")
    p.add_argument("--devices", default="0,1,2,3")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--window", default="400-419")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", required=True)
    p.add_argument("extra", nargs="*", help="more `multigpu train` flags, after --")
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    trees = dict(t.split("=", 1) for t in a.tree)
    results = []
    for turn in range(1, a.turns + 1):
        for name, tree in trees.items():
            r = one_run(a, name, tree, turn)
            results.append(r)
            (Path(a.out) / "turns.json").write_text(json.dumps(results, indent=1) + "\n")
            wait = f"{r['input_wait']:.0%}" if r["input_wait"] is not None else "-"
            print(f"{name} turn {turn} (exit {r['exit']}): epoch 2 {r['img_per_s'] or 0:,.0f} img/s, {wait} waiting",
                  flush=True)
            for n in r["profile"]:
                print(f"  rank {n['rank']}: step {n['step_ms']:.1f} ms, GPU busy {n['gpu_busy_ms']:.1f} "
                      f"(training stream {n['training_stream_ms']:.1f}, nccl exposed {n['nccl_exposed_ms']:.1f}), "
                      f"idle {n['gpu_idle_ms']:.1f}, waiting {n['waiting_for_data_ms']:.1f}", flush=True)
    for name in trees:
        rates = [r["img_per_s"] for r in results if r["tree"] == name and r["img_per_s"]]
        if rates:
            print(f"{name}: median {statistics.median(rates):,.0f} img/s over {len(rates)} runs "
                  f"({', '.join(f'{x:,.0f}' for x in rates)})")


if __name__ == "__main__":
    main()
