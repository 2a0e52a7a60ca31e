"""A folder of JPEG images in ImageFolder layout, generated once and cached, for `--data real`.

    <data-dir>/jpeg-<side>px-<count>/train/class_00/000000.jpg ...
                                    /val/class_00/...
                                    /manifest.json   (written last: its presence means complete)

    <data-dir>/jpeg-detailed-<count>/...            (--images detailed)

The images come from imagegen. The smooth kind (the default): random colour fields with fine
noise, `side` x `side` pixels, side = 8/7 of the training size (256 for 224), like ImageNet images
after the usual short-side resize; cheap to decode. The detailed kind: files of ImageNet's size
and mix (about 100 KB, mean about 500 x 375, a few greyscale and CMYK), whose decoding costs what
ImageNet's does.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from collections.abc import Callable

from multigpu.bench import imagegen
from multigpu.bench.measure import Prepared
from multigpu.core.loading.prefetch_thread import batches_ahead
from multigpu.train.data import jpeg_decoders
from multigpu.train.training import MAX_WORKERS, PREFETCH_FACTOR

CLASSES = 10
VAL_PER_CLASS = 8  # unused by the bench, but load_data needs val/ (and one sample per GPU)


def default_data_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "multigpu" / "bench-images"


def source_side(image_size: int) -> int:
    return max(32, round(image_size * 8 / 7))


# Batches a prepared loader holds beyond the DataLoader's queue, at most: the one being copied to
# the GPU, or those prefetch_thread.finish_in_thread holds with the most helpers a JPEG decoder
# asks for (one too many drained is harmless: from empty a pipeline is only slower).
DEVICE_AHEAD = batches_ahead(jpeg_decoders.NvImageCodecDecoder.threads)
# The most batches queued when timing would start: training.loader_workers() gives at most
# MAX_WORKERS workers, each PREFETCH_FACTOR batches ahead.
MAX_QUEUE_STEPS = MAX_WORKERS * PREFETCH_FACTOR + DEVICE_AHEAD


def images_needed(global_batch: int, warmup: int, steps: int, trials: int) -> int:
    """Training images for one pass with no epoch boundary inside the timed steps (+2 spare steps):
    the warm-up, the queue drained unused, as many steps again to settle, then the trials."""
    return global_batch * (warmup + 2 * MAX_QUEUE_STEPS + steps * trials + 2)


def loader_prepared(loader, train_one: Callable[[object], int], devices: list,
                    info: dict | None = None) -> Prepared:
    """A step that trains on the loader's next batch (`train_one(batch)` returns the samples it
    trained on over all ranks), timed in the input pipeline's steady state.

    While the model is built and warmed up (cuDNN's autotuning, compiling) the loader fills its
    queue: up to workers x prefetch_factor batches that the timed steps would then get for free.
    On 4 GPUs a 15-step trial ended before that queue did, and reported 100 % of the synthetic
    speed where whole epochs waited for data 22-25 % of the time. Steps alone do not empty it
    (the workers refill it meanwhile); so the queued batches are taken off unused, at once, after
    the warm-up, and as many steps again let the pipeline settle from empty. From empty a
    pipeline can only be slower than its steady state, never faster: where the data keeps up,
    the queue fills again and the step sets the pace."""
    batches = _endless(loader)
    inner = getattr(loader, "loader", loader)  # a PreparedLoader's DataLoader
    queued = inner.num_workers * (inner.prefetch_factor or 0) + DEVICE_AHEAD

    def drain() -> None:
        for _ in range(queued):
            next(batches)

    return Prepared(lambda: train_one(next(batches)), devices, info or {}, close=batches.close,
                    drain=drain, extra_warmup=queued)


def _endless(loader):
    while True:  # a new epoch only if the data runs out (the bench sizes it so it does not)
        yield from loader


def ensure_image_folder(root: str | Path | None, count: int, image_size: int,
                        workers: int | None = None, kind: str = "smooth") -> Path:
    """A complete folder of `kind` (imagegen.KINDS) with at least `count` training images;
    generated only when missing."""
    base = Path(root) if root else default_data_dir()
    prefix = f"jpeg-{source_side(image_size)}px" if kind == "smooth" else f"jpeg-{kind}"
    for existing in sorted(base.glob(f"{prefix}-*"), key=_count_of):
        if _count_of(existing) >= count and (existing / "manifest.json").exists():
            return existing
    target = base / f"{prefix}-{count}"
    tmp = base / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    side = source_side(image_size)
    imagegen.write_folder(tmp, kind, count, CLASSES * VAL_PER_CLASS, CLASSES, (side, side), workers)
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
