"""The training data loading of pytorch/examples' ImageNet main.py alone, in N processes at once,
with no GPU step: can this machine's CPUs feed N GPUs at N times the one-GPU rate?

    python benchmarks/auto_public_loader.py DATA --procs N -b 256 -j 10 --epochs E --warmup 5

benchmarks/auto_public_scripts.py (its `loader` mode, and --compare) runs it beside the script's
own runs, on the same data. Each process builds what main.py builds for training: ImageFolder
(DATA/train) with RandomResizedCrop(224), RandomHorizontalFlip, ToTensor and Normalize, and a
DataLoader of -j workers with pin_memory=True, new each epoch as main.py's is (its workers start
again each epoch). The batch is -b / N per process, as `multigpu run --auto` gives each process by
default (--per-gpu: -b per process, as --auto-batch per-gpu). Where GPUs are visible, each process
sees only its own, as under --auto, so that each pins memory for its own GPU; nothing is copied to
it. The processes read disjoint shares of a new random order each epoch (every sample once per
epoch) and start together (a barrier).

Timed as auto_public_runs.throughput times the script's printed batch times: each batch's time is
the time since the last one was handed over, the first --warmup batches of each epoch are not
timed. images/s: the sum over the processes of (images timed / seconds timed), the rate at which
N ranks stepping together would get their batches. The last line printed is
`loader-only: {json}`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _transforms():
    """main.py's training transforms, as it writes them."""
    import torchvision.transforms as transforms

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    return transforms.Compose([transforms.RandomResizedCrop(224),
                               transforms.RandomHorizontalFlip(),
                               transforms.ToTensor(), normalize])


def _one(rank: int, args, gpus: list[str], barrier, results) -> None:
    """One process: its loader each epoch, timed after the warm-up batches."""
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[rank]
    import torch
    import torchvision.datasets as datasets

    dataset = datasets.ImageFolder(os.path.join(args.data, "train"), _transforms())
    batch = args.batch if args.per_gpu else args.batch // args.procs
    pin = torch.cuda.is_available()
    images, seconds, fetched = 0, 0.0, 0
    barrier.wait()
    began = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch))
        share = order[rank::args.procs].tolist()
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=share,
                                             num_workers=args.workers, pin_memory=pin)
        last = time.perf_counter()
        for i, (x, _) in enumerate(loader):
            now = time.perf_counter()
            fetched += len(x)
            if i >= args.warmup:
                images, seconds = images + len(x), seconds + (now - last)
            last = now
    results.put({"rank": rank, "images_timed": images, "seconds_timed": round(seconds, 3),
                 "images_fetched": fetched, "began": began, "ended": time.perf_counter(),
                 "batch": batch, "pin_memory": pin})


def collect(procs, results) -> list[dict] | None:
    """Each process's result; None as soon as one process ended without giving its own."""
    import queue

    parts = []
    while len(parts) < len(procs):
        try:
            parts.append(results.get(timeout=1.0))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                return None
    for p in procs:
        p.join()
    return parts


def visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def summary(parts: list[dict]) -> dict:
    parts = sorted(parts, key=lambda p: p["rank"])
    rates = [p["images_timed"] / p["seconds_timed"] for p in parts if p["seconds_timed"] > 0]
    wall = max(p["ended"] for p in parts) - min(p["began"] for p in parts)
    return {"procs": len(parts), "images_per_s": round(sum(rates), 1),
            "per_process_images_per_s": [round(r, 1) for r in rates],
            "seconds_timed": max(p["seconds_timed"] for p in parts),
            "images_fetched": sum(p["images_fetched"] for p in parts),
            "wall_s": round(wall, 2),
            "batch_per_process": parts[0]["batch"], "pin_memory": parts[0]["pin_memory"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("-b", "--batch", type=int, default=256, help="the script's -b")
    p.add_argument("-j", "--workers", type=int, default=10, help="loader workers per process")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5, help="batches of each epoch not timed")
    p.add_argument("--per-gpu", action="store_true", help="-b per process, not -b / procs")
    args = p.parse_args(argv)
    gpus = visible_gpus()
    if gpus and len(gpus) < args.procs:
        print(f"auto_public_loader: --procs {args.procs} but {len(gpus)} GPU(s) visible",
              file=sys.stderr)
        return 2
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(args.procs), ctx.Queue()
    procs = [ctx.Process(target=_one, args=(r, args, gpus, barrier, results))
             for r in range(args.procs)]
    for proc in procs:
        proc.start()
    parts = collect(procs, results)
    if parts is None:
        print("auto_public_loader: a loader process failed (its traceback is above)",
              file=sys.stderr)
        return 1
    print("loader-only: " + json.dumps(summary(parts)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
