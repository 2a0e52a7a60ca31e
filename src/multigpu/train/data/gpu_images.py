"""folder: images decoded on the GPU (nvImageCodec or torchvision's nvJPEG), the crops done there too.

With `--decode gpu` (or `auto` where it works) loader workers no longer decode: per sample they read
the file and draw its augmentation (the crop box and flip the CPU path would draw, from the same
seeded generator, so a sample's augmentation is a function of (seed, epoch, index) either way), and
the batch leaves them still encoded, as one byte buffer. In a helper thread, on the helper's own
stream, while the previous steps compute (prefetch_thread: as many helpers as the decoder decodes
batches at once, two for nvImageCodec), `decode_batch` decodes it in one
batched call of the process's JPEG decoder (jpeg_decoders: nvImageCodec on the hardware JPEG
engines where it is installed and the GPU has them, else torchvision's nvJPEG), then crops,
resizes (PIL's antialiased bilinear) and flips the whole batch on the GPU in a few batched
kernels (crop_resize). Files that cannot take that way are decoded by the worker as before and
join the batch decoded: not a JPEG, CMYK, progressive (off the engines: slower there than in a
worker), no end-of-image marker (truncated), and the `cpu_share` of samples a hybrid leaves to
the CPUs.

Off CUDA (the CPU tests) the same path runs with PIL (or nvImageCodec's CPU backend) decoding
the bytes, so everything except the GPU decode call is exercised everywhere.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import default_collate

from multigpu.train.data import jpeg_decoders
from multigpu.train.data.crop_resize import crop_resize

_END_OF_IMAGE = b"\xff\xd9"
# Images a second, 500 x 375 JPEGs to 224 x 224, one H100 machine with 16 cores
# (docs/performance.md): one loader worker (15 fed
# ResNet-50 with CUDA graphs at 5338, 99 % of its synthetic speed), and nvJPEG with the crops
# (about 5000 with nothing else running). See choose_share.
CPU_WORKER_RATE, GPU_RATE = 350.0, 5000.0


@dataclass
class EncodedImage:
    """One sample as a worker hands it over: the file's bytes and the augmentation to apply."""
    data: torch.Tensor  # uint8, the whole file
    box: tuple[int, int, int, int]  # left, top, width, height in the decoded image
    flip: bool
    index: int  # in the dataset: names the file if the GPU cannot decode it
    seed: int  # drawn with the crop: the replacement's crop, should the file prove unreadable


class ImageBatch:
    """A batch of folder: images, some still encoded; `decode_batch` finishes it on the device."""

    def __init__(self, samples: list):
        self.count = len(samples)
        encoded = [(i, s) for i, s in enumerate(samples) if isinstance(s, EncodedImage)]
        decoded = [(i, s) for i, s in enumerate(samples) if not isinstance(s, EncodedImage)]
        self.positions = [i for i, _ in encoded]
        self.boxes = [s.box for _, s in encoded]
        self.flips = [s.flip for _, s in encoded]
        self.indices = [s.index for _, s in encoded]
        self.seeds = [s.seed for _, s in encoded]
        self.lengths = [s.data.numel() for _, s in encoded]
        # One buffer: a batch crosses from the worker in one shared-memory tensor, not one per image.
        self.data = torch.cat([s.data for _, s in encoded]) if encoded else torch.empty(0, dtype=torch.uint8)
        self.decoded_at = [i for i, _ in decoded]
        self.decoded = torch.stack([s for _, s in decoded]) if decoded else None

    def pin_memory(self, device=None) -> ImageBatch:
        """DataLoader's pin_memory thread calls this: only the decoded pixels go by DMA; nvJPEG
        stages the encoded bytes itself."""
        if self.decoded is not None:
            self.decoded = self.decoded.pin_memory()
        return self

    def encoded(self) -> list[torch.Tensor]:
        return list(torch.split(self.data, self.lengths)) if self.lengths else []


def collate(samples: list) -> tuple:
    """The loader's collate_fn for folder: datasets: (images, labels), images an ImageBatch when
    any sample is still encoded. Stacked by torch's default_collate, which in a loader worker
    writes the batch straight into shared memory, the way it crosses to the main process (stacked
    in private memory, it was copied again into shared memory to be sent:
    benchmarks/cpu_pipeline.py)."""
    labels = default_collate([y for _, y in samples])
    images = [x for x, _ in samples]
    if all(isinstance(x, torch.Tensor) for x in images):
        return default_collate(images), labels
    return ImageBatch(images), labels


def gpu_readable(data: bytes | memoryview) -> tuple[int, int] | None:
    """(width, height) of a JPEG the GPU path can take (baseline or extended, RGB or grey, ends
    with its end marker), read from its header alone; None otherwise."""
    from PIL import Image

    if bytes(data[:2]) != b"\xff\xd8" or bytes(data[-2:]) != _END_OF_IMAGE:
        return None
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format != "JPEG" or image.mode not in ("RGB", "L") or image.info.get("progressive"):
                return None
            return image.size
    except Exception:  # not an image PIL knows: the worker's own decode reports it
        return None


def workers_suffice(workers: int) -> bool:
    """--decode auto leaves JPEGs to the loader workers alone where they decode at least as fast
    as the GPU path would add (CPU_WORKER_RATE, GPU_RATE).

    Why the workers alone where they can: one decode thread delivers about 3 700 of these images a
    second on an H100, less than 15 workers do. Measured there, ResNet-50 batch 128: eager, all
    three ways reach 93 % of synthetic; with CUDA graphs the workers alone 97-99 %, the hybrid
    85 %, the GPU alone 67-73 % (a 10x shorter GIL switch interval changed nothing). The GPU path
    is for machines with few cores per GPU."""
    return workers * CPU_WORKER_RATE >= GPU_RATE


def hybrid_share(workers: int) -> float:
    """The share of images the loader workers decode under --decode auto where they do not
    suffice alone: their speed over the sum of theirs and the GPU's, in hundredths."""
    cpu = max(workers, 0) * CPU_WORKER_RATE
    return round(cpu / (cpu + GPU_RATE), 2)


def read_bytes(path: str) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def decode_batch(batch: ImageBatch, size: int, device: torch.device, fallback) -> tuple[torch.Tensor, dict]:
    """(uint8 (N, 3, size, size) on `device`, {position: label} of replaced samples).
    `fallback(index, seed, exc)` gives (image, label) of the sample that replaces a file neither
    the device nor PIL could decode."""
    out = torch.empty((batch.count, 3, size, size), dtype=torch.uint8, device=device)
    replaced = {}

    def replace(k: int, exc: BaseException) -> None:
        replaced[k] = fallback(batch.indices[k], batch.seeds[k], exc)

    images = _decode(batch, device, replace)
    good = [k for k in range(len(images)) if k not in replaced]
    if good:
        pixels = crop_resize([images[k] for k in good], [batch.boxes[k] for k in good],
                             [batch.flips[k] for k in good], size)
        out[[batch.positions[k] for k in good]] = pixels.round_().clamp_(0, 255).to(torch.uint8)
    for k, (image, _) in replaced.items():
        out[batch.positions[k]] = image.to(device)
    if batch.decoded is not None:
        out[batch.decoded_at] = batch.decoded.to(device, non_blocking=True)
    return out, {batch.positions[k]: label for k, (_, label) in replaced.items()}


def _decode(batch: ImageBatch, device: torch.device, on_bad) -> list[torch.Tensor | None]:
    """The batch's encoded images decoded on `device`, in one call (jpeg_decoders.choose's
    decoder). A file that fails there and in PIL goes to `on_bad(k, exc)`; the device running
    out of memory or failing is raised, not blamed on a file."""
    from PIL import Image

    encoded = batch.encoded()
    if not encoded:
        return []
    decoder = jpeg_decoders.choose(device)
    if isinstance(decoder, str):  # the run asked for the GPU path where no decoder works
        raise RuntimeError(f"JPEGs cannot be decoded on {device}: {decoder}")
    images = decoder.decode_transient(encoded, device)  # read by the crops on this stream, then let go
    for k, image in enumerate(images):
        if image is not None:
            continue
        try:
            images[k] = jpeg_decoders.pil_decode(encoded[k]).to(device)
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:  # PIL's
            on_bad(k, exc)
    return images


def center_box(width: int, height: int, size: int) -> tuple[int, int, int, int]:
    """(left, top, width, height) of the validation crop in the original image: what resizing the
    shorter side to size * 8/7 and cutting out the centre size x size would keep."""
    short = round(size * 8 / 7)
    side = max(1, min(width, height, round(size * min(width, height) / short)))
    return (width - side) // 2, (height - side) // 2, side, side


# Set to 1, the "GPU" path runs on CPUs too (PIL decoding, the crops in torch): how the CPU tests
# exercise --decode gpu and auto's trial; never faster than the workers there.
CPU_STAND_IN = "MULTIGPU_DECODE_CPU_STAND_IN"


def gpu_decode_problem(device: torch.device) -> str | None:
    """Why JPEGs cannot be decoded on `device` (one line), or None when they can: each GPU
    decoder in turn decodes a small JPEG made here, once per process and device
    (jpeg_decoders.choose)."""
    if device.type != "cuda":
        if os.environ.get(CPU_STAND_IN) == "1":
            return None
        return f"the run's device is {device.type}, not a GPU"
    chosen = jpeg_decoders.choose(device)
    return chosen if isinstance(chosen, str) else None


def decoder_name(device: torch.device) -> str:
    """The decoder of `device`'s JPEGs as the start-up line names it."""
    chosen = jpeg_decoders.choose(device)
    return "no decoder" if isinstance(chosen, str) else chosen.name


def decoder_threads(device: torch.device) -> int:
    """Batches `device`'s JPEG decoder decodes at once (JpegDecoder.threads); 1 off CUDA."""
    chosen = jpeg_decoders.choose(device) if device.type == "cuda" else None
    return chosen.threads if isinstance(chosen, jpeg_decoders.JpegDecoder) else 1
