"""`folder:PATH` data: an ImageFolder layout decoded with PIL, and what happens to a broken image.

    PATH/train/<class>/<image>    PATH/val/<class>/<image>

Classes are the sorted folder names under train/ (at least two). Training images get a random
resized crop and a random flip; validation images are resized and centre-cropped. Samples are uint8
(C, H, W); the float conversion and normalisation happen on the device (DataBundle.normalize).

Decoding: torchvision where it is installed (torchvision.io.decode_image, then the crop by
transforms.v2.functional.resized_crop on the uint8 tensor), PIL otherwise and for the formats
torchvision.io does not read (BMP, PPM, TIFF); with --decode gpu, nvJPEG on the GPU (gpu_images).
Every path draws the same crop box and flip for a sample (ImageFolderDataset._crop), so which one
decodes changes pixels by a level or so, never the augmentation. Measured on one thread of an H100
machine's CPU (benchmarks/image_transforms.py, 500x375 JPEGs, torch 2.11, torchvision 0.26):
torchvision 304 training / 306 validation images a second against PIL's 216 / 172 (with v2's own
RandomResizedCrop then; the crop is now the same box, one resize). Seeded workers repeat their crops.

A file that cannot be decoded (truncated, not an image, ...): with `--bad-images skip` (the
default: one unreadable file among a million must not end a week-long run at 99 %) it is replaced
by the next readable image of the same split, so every step keeps its sample count, and it is
named once in a warning and counted (`bad_images` in metrics.jsonl); when more than 10 and more
than 1 % of an epoch's images were bad the run stops, since the data itself is broken.
With `--bad-images fail` the first one stops the run, naming the file.
"""
from __future__ import annotations

import functools
import math
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from multigpu.train.data import gpu_images
from multigpu.train.data.data_config import DECODE_CHOICES
from multigpu.train.data.data_bundle import IMAGENET_MEAN, IMAGENET_STD, DataBundle
from multigpu.core.errors import UsageError
from multigpu.train.data.folder_layout import check_classes, check_root, class_images

BAD_IMAGE_CHOICES = ("skip", "fail")
DECODERS = ("torchvision", "pil")
_TORCHVISION_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".gif", ".webp"})
MAX_BAD_FRACTION, MAX_BAD_ALWAYS_ALLOWED = 0.01, 10
_SLOTS = 256  # one counter per DataLoader worker (and one for the main process): no races
# Unreadable files are counted per epoch: workers decode the next epoch's first batches before
# this one ends (loaders.EpochAfterEpoch). A row per epoch, modulo _EPOCH_ROWS (the workers run at
# most workers x prefetch_factor batches ahead), and a last row for samples made without an epoch
# tag (no workers, or on the device), which belong to the epoch being counted.
_EPOCH_ROWS = 64


class BadImageError(UsageError):
    """An image that cannot be decoded, with --bad-images fail."""


class ImageFolderDataset(Dataset):
    """Decodes images with PIL; training samples get a random resized crop and flip, validation a
    centre crop. An unreadable file is handled per `bad_images` (module docstring)."""

    bad_fix = "delete or replace the file"  # what --bad-images fail's line tells the user to do

    def __init__(self, samples: list[tuple[str, int]], classes: list[str], image_size: int,
                 train: bool, bad_images: str = "skip", decoder: str | None = None) -> None:
        if bad_images not in BAD_IMAGE_CHOICES:
            raise UsageError(f"--bad-images {bad_images}: choose skip or fail")
        self.samples, self.classes, self.image_size, self.train = samples, classes, image_size, train
        self.bad_images = bad_images
        # on_gpu: JPEGs leave the workers encoded and are decoded on the device (gpu_images), but
        # for the `cpu_share` of samples (0-1) the workers decode anyway (a hybrid). Both are set
        # by use_decode once the run's device is known. The share is in shared memory and read
        # per sample: --decode auto's trial (decode_choice) changes it in the running workers.
        self._share = torch.tensor([0.0], dtype=torch.float64).share_memory_()
        self.on_gpu, self.measure_decode = False, False
        self.decoder = decoder or default_decoder()
        # Shared memory, so counts made in DataLoader workers reach the main process.
        self.bad_counts = torch.zeros(_EPOCH_ROWS + 1, _SLOTS, dtype=torch.int64).share_memory_()
        self.sample_epoch: int | None = None  # set per sample in workers (loaders.PerSampleSeed)
        self.made_counts = torch.zeros(_SLOTS, dtype=torch.int64).share_memory_()  # samples made
        self._named: set[str] = set()
        # The device path's replacements run in its finishing threads, two at once: one count each.
        self._bad_lock, self._bad_pid = threading.Lock(), os.getpid()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_bad_lock"] = None  # a lock is this process's own
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._bad_lock, self._bad_pid = threading.Lock(), os.getpid()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def cpu_share(self) -> float:
        return float(self._share[0])

    @cpu_share.setter
    def cpu_share(self, share: float) -> None:
        self._share[0] = share  # in place: the workers hold the same memory

    @property
    def made_count(self) -> int:
        """Samples made so far by this process and its loader workers (decode_choice's rates)."""
        return int(self.made_counts.sum())

    @property
    def bad_count(self) -> int:
        """Unreadable files met so far and not yet taken (each time one is met)."""
        return int(self.bad_counts.sum())

    def take_bad_count(self, epoch: int) -> int:
        """Unreadable files met in epoch `epoch` (0-based), once: its count starts again at 0."""
        rows = [epoch % _EPOCH_ROWS, _EPOCH_ROWS]
        n = int(self.bad_counts[rows].sum())
        self.bad_counts[rows] = 0
        return n

    def __getitem__(self, index: int) -> tuple[torch.Tensor | gpu_images.EncodedImage, torch.Tensor]:
        item = self._item(index, self.on_gpu)
        self.made_counts[_slot()] += 1
        return item

    def _item(self, index: int, on_gpu: bool, own: bool = True, generator=None):
        """Sample `index`, or the next readable one. A bad file is counted only as its own sample
        (`own`, offset 0), not again each time a walk to the next readable file passes it: each is
        then counted once an epoch. Crops draw from `generator` (default: torch's global one)."""
        for offset in range(len(self.samples)):
            at = (index + offset) % len(self.samples)
            path, label = self.samples[at]
            try:
                # A walk to the next readable file stays on the CPU: a file sent to the GPU
                # and failing there would be counted by the replacement and by its own sample.
                image = (on_gpu and offset == 0 and self._encoded(path, at)) or self._read(at, generator)
            except Exception as exc:  # PIL: OSError, SyntaxError, ValueError, DecompressionBombError;
                self._bad(path, exc, count=own and offset == 0)  # torchvision: RuntimeError
                continue
            return image, torch.tensor(label, dtype=torch.int64)
        raise UsageError("no image of this split can be read: check the files of --data folder:")

    def _crop(self, width: int, height: int, generator=None) -> tuple[tuple[int, int, int, int], bool, int]:
        """(box, flip, seed) of one sample: the same draws, in the same order, whichever decoder
        (the seed is for a replacement on the GPU path; every path draws it, so that 0-worker
        loaders' global generator moves alike)."""
        if not self.train:
            return gpu_images.center_box(width, height, self.image_size), False, 0
        box = _random_box(width, height, generator)
        flip = float(torch.rand(1, generator=generator)) < 0.5
        return box, flip, int(torch.randint(2**62, (1,), generator=generator))

    def _encoded(self, path: str, index: int) -> gpu_images.EncodedImage | None:
        """The file's bytes and this sample's crop, for the device to decode; None when the file
        or the hybrid's share leaves it to the CPU path (gpu_images)."""
        share = self.cpu_share
        if math.floor((index + 1) * share) > math.floor(index * share):
            return None  # the hybrid's share, spread evenly over the indices
        if Path(path).suffix.lower() not in (".jpg", ".jpeg"):
            return None
        data = self._data(at=index)
        size = gpu_images.gpu_readable(memoryview(data.numpy()))
        if size is None:
            return None
        box, flip, seed = self._crop(*size)
        return gpu_images.EncodedImage(data, box, flip, index, seed)

    collate = staticmethod(gpu_images.collate)

    @property
    def on_device(self):
        """What the prepared loader calls on each batch on the device, ahead of the step (in a
        thread: prefetch_thread), when JPEGs are decoded there; None otherwise."""
        return self._finish_on_device if self.on_gpu else None

    def on_device_threads(self, device: torch.device) -> int:
        """Batches to finish on `device` at once (prefetch_thread): as many as its JPEG decoder
        decodes at once."""
        return gpu_images.decoder_threads(device)

    def _finish_on_device(self, batch, device: torch.device):
        """Images still encoded are decoded on `device` (gpu_images.decode_batch)."""
        images, labels = batch
        if isinstance(images, gpu_images.ImageBatch):
            images, replaced = gpu_images.decode_batch(images, self.image_size, device, self._replacement)
            for position, label in replaced.items():
                labels[position] = label
        return images, labels

    def _replacement(self, index: int, seed: int, exc: BaseException) -> tuple[torch.Tensor, torch.Tensor]:
        """A file the device and PIL both failed on: named and counted (or, with --bad-images
        fail, the end of the run), and the next readable sample, image and label, made on the CPU
        with a generator seeded from the sample (not torch's global one: this runs in a thread)."""
        self._bad(self.samples[index][0], exc)
        return self._item(index + 1, on_gpu=False, own=False,
                          generator=torch.Generator().manual_seed(seed))

    def _data(self, at: int) -> torch.Tensor:
        """Sample `at`'s file, its bytes as uint8 (shards.ShardDataset: from its shard)."""
        return gpu_images.read_bytes(self.samples[at][0])

    def _opened(self, at: int):
        """What PIL opens for sample `at`: its path (shards.ShardDataset: its bytes)."""
        return self.samples[at][0]

    def _read(self, at: int, generator=None) -> torch.Tensor:
        path = self.samples[at][0]
        if self.decoder == "torchvision" and Path(path).suffix.lower() in _TORCHVISION_SUFFIXES:
            from torchvision.io import ImageReadMode, decode_image
            from torchvision.transforms.v2 import functional as TF

            try:
                image = decode_image(self._data(at), mode=ImageReadMode.RGB)
            except RuntimeError:  # PIL next: it reads some files torchvision does not, and
                image = None      # where neither can, its reason is the one users know
            if image is not None:
                if image.ndim == 4:  # an animated GIF: its first frame, as PIL reads it
                    image = image[0]
                (left, top, w, h), flip, _ = self._crop(image.shape[2], image.shape[1], generator)
                image = TF.resized_crop(image, top, left, h, w, [self.image_size] * 2, antialias=True)
                return (image.flip(-1) if flip else image).contiguous()
        image = _decode(self._opened(at))
        (left, top, w, h), flip, _ = self._crop(*image.size, generator)
        return _to_tensor(_resize_box(image, (left, top, w, h), flip, self.image_size))

    def _bad(self, path: str, exc: BaseException, count: bool = True) -> None:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self.bad_images == "fail":
            raise BadImageError(f"cannot read image '{path}' ({why}): {self.bad_fix}, "
                                "or pass --bad-images skip to train without it")
        if self._bad_pid != os.getpid():  # a forked worker: the lock may have been copied held
            self._bad_lock, self._bad_pid = threading.Lock(), os.getpid()
        with self._bad_lock:
            if count:
                row = _EPOCH_ROWS if self.sample_epoch is None else self.sample_epoch % _EPOCH_ROWS
                self.bad_counts[row, _slot()] += 1
            named = path in self._named
            self._named.add(path)
        if not named:
            print(f"multigpu: warning: skipped unreadable image '{path}' ({why}); the next image "
                  "of the split takes its place (--bad-images fail to stop instead)",
                  file=sys.stderr, flush=True)


def _slot() -> int:
    """This process's counter: one per DataLoader worker, 0 for the main process."""
    info = get_worker_info()
    return (info.id + 1) % _SLOTS if info else 0


@functools.cache
def default_decoder() -> str:
    """"torchvision" where it imports (the faster path, module docstring), else "pil". Asked once
    a process: a failed import is not cached by Python and would be tried again for each split."""
    try:
        import torchvision.io  # noqa: F401
        import torchvision.transforms.v2  # noqa: F401
    except Exception:  # not installed, or built for another torch ("operator ... does not exist")
        return "pil"
    return "torchvision"


def _decode(path):
    """RGB pixels of `path`: a file's path, or a file object of its bytes."""
    from PIL import Image

    with Image.open(path) as raw:
        return raw.convert("RGB")


def _random_box(width: int, height: int, generator=None) -> tuple[int, int, int, int]:
    """(left, top, width, height) of a random region: 35-100% of the area, aspect 3/4-4/3."""
    area = width * height
    for _ in range(10):
        target = area * float(torch.empty(1).uniform_(0.35, 1.0, generator=generator))
        aspect = math.exp(float(torch.empty(1).uniform_(math.log(3 / 4), math.log(4 / 3), generator=generator)))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(torch.randint(width - w + 1, (1,), generator=generator))
            top = int(torch.randint(height - h + 1, (1,), generator=generator))
            return left, top, w, h
    side = min(width, height)  # very elongated image: the largest centred square
    return (width - side) // 2, (height - side) // 2, side, side


def _resize_box(image, box: tuple[int, int, int, int], flip: bool, size: int):
    """PIL: the box resized to size x size (bilinear, antialiased), mirrored if `flip`."""
    from PIL import Image

    left, top, w, h = box
    image = image.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image


def _to_tensor(image) -> torch.Tensor:
    """uint8 (C, H, W); see DataBundle.normalize."""
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous()


def load_folder(path: str, image_size: int, bad_images: str = "skip", decoder: str | None = None) -> DataBundle:
    root = check_root(path)
    train_images = class_images(root / "train")
    val_images = class_images(root / "val")
    check_classes(root, train_images, val_images)
    classes = list(train_images)
    index = {name: i for i, name in enumerate(classes)}

    def pairs(images: dict[str, list[str]]) -> list[tuple[str, int]]:
        return [(file, index[name]) for name, files in images.items() for file in files]

    return DataBundle(
        train=ImageFolderDataset(pairs(train_images), classes, image_size, True, bad_images, decoder),
        val=ImageFolderDataset(pairs(val_images), classes, image_size, False, bad_images, decoder),
        task="classification",
        input_shape=(3, image_size, image_size),
        num_outputs=len(classes),
        name=f"folder:{path}",
        normalize=(IMAGENET_MEAN, IMAGENET_STD),
    )




def use_decode(data: DataBundle, asked: str, device: torch.device, workers: int,
               deterministic: bool = False, trial: bool = False) -> str | None:
    """Where folder: JPEGs get decoded (`--decode`), set on both datasets; returns the line that
    says so on a GPU run (None for other data, or on CPUs where there is no choice).

    auto, where the GPU can decode and the caller runs the trial (`trial`: the training loop,
    decode_choice): measured in the job (the train dataset's `measure_decode` is set, and it
    starts as the rule below has it). With --deterministic, or for a caller without the trial
    (doctor, bench), the rule alone: the workers alone when there are enough of them, else the GPU
    alone, so that a run resumed with other workers decodes every image as before."""
    if not isinstance(data.train, ImageFolderDataset):
        return None
    if asked not in DECODE_CHOICES:
        raise UsageError(f"--decode {asked}: choose {', '.join(DECODE_CHOICES)}")
    measure = asked == "auto" and trial and not deterministic
    # The probe starts a GPU decoder (its handles and memory stay for the run): only where
    # the GPU might decode.
    workers_alone = asked == "cpu" or (asked == "auto" and not measure and gpu_images.workers_suffice(workers))
    problem = None if workers_alone else gpu_images.gpu_decode_problem(device)
    if asked == "gpu" and problem:
        raise UsageError(f"--decode gpu: {problem}; use --decode cpu (the loader workers decode) "
                         "or auto")
    auto = asked == "auto" and problem is None
    on_gpu = asked == "gpu" or (auto and (measure or not gpu_images.workers_suffice(workers)))
    share = 0.0
    if measure and auto:  # the rule's choice until the trial's
        share = 1.0 if gpu_images.workers_suffice(workers) else gpu_images.hybrid_share(workers)
    data.train.measure_decode = measure and auto
    for dataset in (data.train, data.val):
        dataset.on_gpu, dataset.cpu_share = on_gpu, share
    if device.type != "cuda":
        return None
    decoder = gpu_images.decoder_name(device) if on_gpu else ""
    if measure and auto:
        return (f"folder: --decode auto: {workers} loader workers, {device} ({decoder}) and both "
                "are timed in turns in the first epoch; the fastest is kept for the run")
    if on_gpu:
        return (f"folder: JPEGs decoded on {device} ({decoder}), the crops there too; {workers} loader "
                "workers read the files (--decode cpu: the workers decode)")
    why = ("--decode cpu" if asked == "cpu" else f"the GPU path is off: {problem}" if problem
           else "enough of them: --decode gpu to decode on the GPU")
    return f"folder: images decoded by {workers} loader workers per GPU ({why})"
