"""The same images as `folder:` and as `shards:` on CPU: the loader alone and a whole epoch.

    PYTHONPATH=src python benchmarks/shards_vs_folder.py --out DIR [--images 800] [--rounds 3]
        [--workers 2] [--data /tmp/multigpu-shards-bench]

In one invocation: a folder of `--images` generated JPEGs (multigpu.bench.imagegen, "detailed",
like ImageNet's files, mean about 500 x 375) is made under --data, packed with
`multigpu pack` (timed: the copy and, apart, the index build of every shard), then, for
--rounds rounds, alternating folder and shards so that a change in the machine's load falls
on both:
1. the loader alone: one epoch of the train split through loaders.shard_loader as `multigpu
   train` builds it (--workers workers, batch 32, 224 x 224 crops, decoded in the workers);
2. a whole epoch: `multigpu train --model linear --epochs 1 --devices cpu:1 --workers W`, its
   epoch_seconds from metrics.jsonl (the training and validation step included).
The page cache is dropped before each (echo 3 > /proc/sys/vm/drop_caches) where this process
may, else the reads are warm and results.json says so. Medians, the ratio shards / folder, the
load average and the machine go to DIR/results.json, and a table is printed.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from multigpu.bench import imagegen
from multigpu.core.loading.loaders import shard_loader
from multigpu.train.data import shard_index, shard_layout, shard_pack
from multigpu.train.data.datasets import load_data

SIZE, BATCH = 224, 32


def drop_cache() -> bool:
    """Whether the page cache was dropped (root on Linux), so the next reads come from the disk."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def loader_alone(spec: str, workers: int) -> float:
    """Images a second of one training epoch through the prepared loader."""
    train = load_data(spec, input_kind="image", image_size=SIZE).train
    loader = shard_loader(DataLoader(train, batch_size=BATCH, shuffle=True, num_workers=workers,
                                     collate_fn=train.collate),
                          layout=(1, 0, 1), device=torch.device("cpu"),
                          seed=0, on_step=lambda info: None)
    began, images = time.perf_counter(), 0
    for x, _ in loader:
        images += x.shape[0]
    return images / (time.perf_counter() - began)


def whole_epoch(spec: str, workers: int, out: Path) -> float:
    """epoch_seconds of a one-epoch `multigpu train` run on one CPU process."""
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "multigpu", "train", "--model", "linear", "--data", spec,
                           "--image-size", str(SIZE), "--epochs", "1", "--batch-size", str(BATCH),
                           "--devices", "cpu:1", "--workers", str(workers), "--logger", "none",
                           "--checkpoint-every", "0", "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["epoch_seconds"]


def pack(folder: Path, shards: Path) -> dict:
    """Pack (timed), then the index build alone: every index removed and built again."""
    shutil.rmtree(shards, ignore_errors=True)
    began = time.perf_counter()
    shard_pack.pack(str(folder), shards, shard_size=16 * 10**6)
    packed = time.perf_counter() - began
    for index in shards.glob("*.idx.json"):
        index.unlink()
    cold = drop_cache()
    began = time.perf_counter()
    shard_layout.check_shards(str(shards))  # what `multigpu train` does before its launch
    built = time.perf_counter() - began
    images = sum(len(shard_index.shard_samples(s)) for s in shards.glob("*.tar"))
    return {"pack_s": round(packed, 2), "index_build_s": round(built, 3), "index_cold": cold,
            "index_us_per_image": round(1e6 * built / images, 1), "shards": len(list(shards.glob("*.tar"))),
            "bytes": sum(s.stat().st_size for s in shards.glob("*.tar"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--images", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", type=Path, default=Path("/tmp/multigpu-shards-bench"))
    args = parser.parse_args()
    folder = args.data / f"detailed-{args.images}"
    if not (folder / "manifest.json").exists():
        # every image its own file (imagegen links repeats past its DISTINCT): a pack copies each
        imagegen.write_folder(folder, "detailed", args.images, max(40, args.images // 8))
    shards = args.data / f"shards-{args.images}"
    result = {"images": args.images, "workers": args.workers, "batch": BATCH, "size": SIZE,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "load_before": os.getloadavg()},
              "pack": pack(folder, shards), "runs": {"folder": [], "shards": []}}
    cold = []
    for _ in range(args.rounds):
        for name, spec in (("folder", f"folder:{folder}"), ("shards", f"shards:{shards}")):
            cold.append(drop_cache())
            alone = loader_alone(spec, args.workers)
            cold.append(drop_cache())
            epoch = whole_epoch(spec, args.workers, args.data / "run")
            result["runs"][name].append({"loader_images_per_s": round(alone, 1), "epoch_s": round(epoch, 2)})
            print(name, result["runs"][name][-1], flush=True)
    result["page_cache"] = "dropped before each" if all(cold) else "warm (could not drop it)"
    result["machine"]["load_after"] = os.getloadavg()
    median = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
              for name, runs in result["runs"].items()}
    result["median"] = median
    result["shards_over_folder"] = {key: round(median["shards"][key] / median["folder"][key], 3)
                                    for key in ("loader_images_per_s", "epoch_s")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("pack", "median", "shards_over_folder", "page_cache")}, indent=1))


if __name__ == "__main__":
    main()
