"""Where a rank's host time goes during whole `multigpu train` epochs on real JPEGs: py-spy samples
every thread of rank 0 (not paused: --nonblocking) for a few seconds of its second epoch, then
again only where a thread holds the GIL, and the samples are summed per thread and per frame (which
function the thread was in, and which of ours called it). The GPU's side comes from the same run's
MULTIGPU_PROFILE_STEPS window.

    python benchmarks/host_profile.py --folder DIR --decode cpu,gpu --out OUT [--devices 0,1,2,3]

Needs py-spy (pip install py-spy; the GPU machines get its wheel carried). Writes OUT/<decode>/
(the run folder, its profile/, pyspy-idle.txt and pyspy-gil.txt: py-spy's raw collapsed stacks) and prints per run the
epoch lines, the profile line and each thread's top frames.
"""
import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def rank_processes(launcher: psutil.Process) -> list[psutil.Process]:
    """The ranks: descendants of the launcher that have LOCAL_RANK and whose parent has none."""
    found = []
    for p in launcher.children(recursive=True):
        try:
            if "LOCAL_RANK" in p.environ() and "LOCAL_RANK" not in p.parent().environ():
                found.append(p)
        except psutil.Error:
            pass
    return sorted(found, key=lambda p: int(p.environ()["LOCAL_RANK"]))


def summarize(raw: Path, top: int) -> str:
    """py-spy --format raw lines: 'thread (0x..);frame;frame;... count' (outermost first)."""
    per_thread, per_leaf = collections.Counter(), collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread, count = frames[0], int(count)
        per_thread[thread] += count
        leaf = frames[-1].split(" (")[0]
        ours = next((f.split(" (")[0] for f in reversed(frames) if "multigpu" in f), "-")
        per_leaf[thread][f"{leaf}  <- {ours}"] += count
    total = sum(per_thread.values()) or 1
    lines = []
    for thread, n in per_thread.most_common():
        lines.append(f"{thread}: {n} samples ({n / total:.0%})")
        lines += [f"    {c / n:6.1%}  {name}" for name, c in per_leaf[thread].most_common(top)]
    return "\n".join(lines)


def one_run(a, decode: str) -> None:
    out = Path(a.out) / decode
    env = {**os.environ, **ENV, "MULTIGPU_PROFILE_STEPS": a.window}
    cmd = [sys.executable, "-m", "multigpu", "train", "--model", a.model, "--data", f"folder:{a.folder}",
           "--batch-size", str(a.batch_size), "--epochs", "2", "--precision", a.precision, "--devices", a.devices,
           "--logger", "none", "--checkpoint-every", "0", "--decode", decode, "--out", str(out / "run")]
    log = open(out.with_suffix(".log"), "w")
    launcher = psutil.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    began = time.time()
    while time.time() - began < a.timeout and launcher.poll() is None:  # epoch 1 done: in epoch 2
        if "epoch 1 " in Path(log.name).read_text():
            break
        time.sleep(0.5)
    time.sleep(a.settle)
    ranks = rank_processes(launcher)
    for kind in ("idle", "gil") if ranks else ():  # every sample; then only those holding the GIL
        subprocess.run(["py-spy", "record", "--pid", str(ranks[0].pid), "--duration", str(a.seconds),
                        "--rate", "200", "--nonblocking", "--threads", f"--{kind}", "--format", "raw",
                        "--output", str(out / f"pyspy-{kind}.txt")], capture_output=True, timeout=a.seconds + 60)
    try:
        launcher.wait(timeout=max(10, a.timeout - (time.time() - began)))
    except psutil.TimeoutExpired:
        launcher.terminate()
        launcher.wait(30)
    text = Path(log.name).read_text()
    print(f"== --decode {decode} (exit {launcher.returncode})")
    print("\n".join(line[:400] for line in text.splitlines() if line.startswith(("epoch ", "profile of"))))
    for kind in ("idle", "gil"):
        if (out / f"pyspy-{kind}.txt").exists():
            print(f"-- py-spy, rank 0, {'every sample' if kind == 'idle' else 'holding the GIL'}")
            print(summarize(out / f"pyspy-{kind}.txt", a.top))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--decode", default="cpu,gpu")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--devices", default="0,1,2,3")
    p.add_argument("--window", default="300-319", help="MULTIGPU_PROFILE_STEPS of each run")
    p.add_argument("--settle", type=float, default=4.0, help="seconds into epoch 2 before sampling")
    p.add_argument("--seconds", type=int, default=6, help="py-spy's sampling time")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    for decode in a.decode.split(","):
        (Path(a.out) / decode).mkdir(parents=True, exist_ok=True)
        one_run(a, decode)


if __name__ == "__main__":
    main()
