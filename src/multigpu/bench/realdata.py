"""A folder of JPEG images in ImageFolder layout, generated once and cached, for `--data real`.

    <data-dir>/jpeg-<side>px-<count>/train/class_00/000000.jpg ...
                                    /val/class_00/...
                                    /manifest.json   (written last: its presence means complete)

The content is smooth random colour fields with fine noise, so JPEG decoding costs roughly what a
photo of the same size costs (pure noise would be slower to decode, flat colour much faster). The
images are `side` x `side` pixels, side = 8/7 of the training size (256 for 224), like ImageNet
images after the usual short-side resize; real ImageNet files are larger on average (about
500 x 375), so decoding them costs more than decoding these.
"""
from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from multigpu.training import MAX_WORKERS, PREFETCH_FACTOR

CLASSES = 10
VAL_PER_CLASS = 8  # unused by the bench, but load_data needs val/ (and one sample per GPU)


def default_data_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "multigpu" / "bench-images"


def source_side(image_size: int) -> int:
    return max(32, round(image_size * 8 / 7))


# The most steps the worker adds to the warm-up to drain the loader's prefetch queue:
# training.loader_workers() gives at most MAX_WORKERS workers, each PREFETCH_FACTOR batches ahead.
MAX_QUEUE_STEPS = MAX_WORKERS * PREFETCH_FACTOR


def images_needed(global_batch: int, warmup: int, steps: int, trials: int) -> int:
    """Training images for one pass with no epoch boundary inside the timed steps (+2 spare steps)."""
    return global_batch * (warmup + MAX_QUEUE_STEPS + steps * trials + 2)


def ensure_image_folder(root: str | Path | None, count: int, image_size: int,
                        workers: int | None = None) -> Path:
    """A complete folder with at least `count` training images; generated only when missing."""
    base = Path(root) if root else default_data_dir()
    side = source_side(image_size)
    for existing in sorted(base.glob(f"jpeg-{side}px-*"), key=_count_of):
        if _count_of(existing) >= count and (existing / "manifest.json").exists():
            return existing
    target = base / f"jpeg-{side}px-{count}"
    tmp = base / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    jobs = [(tmp / "train" / f"class_{i % CLASSES:02d}" / f"{i:07d}.jpg", i, side)
            for i in range(count)]
    jobs += [(tmp / "val" / f"class_{c:02d}" / f"{count + c * VAL_PER_CLASS + k:07d}.jpg",
              count + c * VAL_PER_CLASS + k, side)
             for c in range(CLASSES) for k in range(VAL_PER_CLASS)]
    for split in ("train", "val"):
        for c in range(CLASSES):
            (tmp / split / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    workers = workers or max(1, min(32, os.cpu_count() or 1))
    if workers == 1 or len(jobs) < 256:
        for job in jobs:
            _write_one(job)
    else:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(_write_one, jobs, chunksize=256))
    (tmp / "manifest.json").write_text(json.dumps(
        {"train_images": count, "classes": CLASSES, "side": side, "format": "jpeg q90"}) + "\n")
    if target.exists():  # a concurrent run finished the same folder first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return target


def _count_of(path: Path) -> int:
    try:
        return int(path.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def _write_one(job: tuple[Path, int, int]) -> None:
    import numpy as np
    from PIL import Image

    path, seed, side = job
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((side, side), Image.Resampling.BICUBIC), dtype=np.int16)
    noisy = smooth + rng.integers(-12, 13, (side, side, 3), dtype=np.int16)
    Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(path, "JPEG", quality=90)
