"""The folder: input pipeline alone, no model: images per second that reach one GPU, per decode mode.

    python benchmarks/decode_pipeline.py --make DIR [--kind smooth|detailed] [--train 12800]  # once
    python benchmarks/decode_pipeline.py --folder DIR --out FILE.json [--workers 15] [--batches 60]

What `multigpu train --data folder:DIR` builds on one GPU (imagefolder + loaders.shard_loader and
its copy stream), iterated without a step: `cpu` (the workers decode), `gpu` (nvJPEG on the copy
stream), and `hybrid-S` (a share S of each batch decoded by the workers, the rest on the GPU).
--make writes a generated folder (multigpu.bench.imagegen): smooth 500 x 375 JPEGs, or detailed
ones like ImageNet's files (~100 KB, mixed sizes, a few greyscale and CMYK).
Modes take turns, round by round; the median round is reported. The first batches of a round
(the workers' queue filling) are left out of the timing.
"""
import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from multigpu.bench import imagegen
from multigpu.train import imagefolder
from multigpu.core.loaders import shard_loader


def loader_for(data, mode: str, workers: int, batch: int, device):
    train = data.train
    train.on_gpu = mode != "cpu"
    train.cpu_share = float(mode.split("-")[1]) if mode.startswith("hybrid-") else 0.0
    loader = DataLoader(train, batch_size=batch, shuffle=True, num_workers=workers, collate_fn=train.collate,
                        persistent_workers=True, prefetch_factor=4)
    return shard_loader(loader, num_ranks=1, rank=0, devices_per_rank=1, device=device, seed=0,
                        on_step=lambda info: None)


def time_round(prepared, batches: int, skip: int) -> float:
    it = iter(prepared)
    for _ in range(skip):
        next(it)
    torch.cuda.synchronize()
    start, images = time.perf_counter(), 0
    for _ in range(batches):
        x, _ = next(it)
        images += x.shape[0]
    torch.cuda.synchronize()
    return images / (time.perf_counter() - start)


def _manifest(folder: str) -> dict:
    path = Path(folder) / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--make")
    p.add_argument("--kind", choices=imagegen.KINDS, default="smooth")
    p.add_argument("--train", type=int, default=12800)
    p.add_argument("--folder")
    p.add_argument("--out")
    p.add_argument("--workers", type=int, default=15)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="cpu,gpu,hybrid-0.47")
    a = p.parse_args()
    if a.make:
        start = time.perf_counter()
        imagegen.write_folder(Path(a.make), a.kind, a.train, 256)
        print(f"{a.train} {a.kind} images in {a.make}: {time.perf_counter() - start:.0f} s")
        return
    device = torch.device("cuda", 0)
    data = imagefolder.load_folder(a.folder, 224)
    modes = a.modes.split(",")
    loaders = {m: loader_for(imagefolder.load_folder(a.folder, 224), m, a.workers, a.batch, device) for m in modes}
    rounds = {m: [] for m in modes}
    skip = max(2, a.workers * 4 // 4)  # a round starts a new epoch: let the queue fill first
    for _ in range(a.rounds):
        for m in modes:
            rounds[m].append(round(time_round(loaders[m], a.batches, skip), 1))
            print(m, rounds[m][-1], flush=True)
    result = {"what": "images/s reaching one GPU from the folder: pipeline, no model",
              "images": len(data.train), "shape": _manifest(a.folder).get("shape", "500x375 JPEG q90"),
              "kind": _manifest(a.folder).get("kind", "smooth"), "size": 224, "batch": a.batch,
              "workers": a.workers, "batches_timed": a.batches, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0), "cpus": len(__import__("os").sched_getaffinity(0)),
              "python": platform.python_version(),
              "median": {m: statistics.median(v) for m, v in rounds.items()}, "rounds": rounds}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median"]))


if __name__ == "__main__":
    main()
