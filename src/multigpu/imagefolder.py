"""`folder:PATH` data: an ImageFolder layout decoded with PIL, and what happens to a broken image.

    PATH/train/<class>/<image>    PATH/val/<class>/<image>

Classes are the sorted folder names under train/ (at least two). Training images get a random
resized crop and a random flip; validation images are resized and centre-cropped. Samples are uint8
(C, H, W); the float conversion and normalisation happen on the device (DataBundle.normalize).

Decoding: torchvision where it is installed (torchvision.io.decode_image, then transforms.v2 on
the uint8 tensor), PIL otherwise and for the formats torchvision.io does not read (BMP, PPM, TIFF).
Measured on one thread of an H100 machine's CPU (benchmarks/image_transforms.py, 500x375 JPEGs,
torch 2.11, torchvision 0.26): torchvision 304 training / 306 validation images a second against
PIL's 216 / 172; torchvision's transforms on PIL images were the slowest (196 / 169). Both paths
draw their randomness from torch's generator, so seeded workers repeat their crops.

A file that cannot be decoded (truncated, not an image, ...): with `--bad-images skip` (the
default: one unreadable file among a million must not end a week-long run at 99 %) it is replaced
by the next readable image of the same split, so every step keeps its sample count, and it is
named once in a warning and counted (`bad_images` in metrics.jsonl); when more than 10 and more
than 1 % of an epoch's images were bad the run stops, since the data itself is broken.
With `--bad-images fail` the first one stops the run, naming the file.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from multigpu import gpu_images
from multigpu.config import DECODE_CHOICES
from multigpu.datasets import IMAGE_SUFFIXES, IMAGENET_MEAN, IMAGENET_STD, DataBundle
from multigpu.errors import UsageError

BAD_IMAGE_CHOICES = ("skip", "fail")
DECODERS = ("torchvision", "pil")
_TORCHVISION_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".gif", ".webp"})
MAX_BAD_FRACTION, MAX_BAD_ALWAYS_ALLOWED = 0.01, 10
_SLOTS = 256  # one counter per DataLoader worker (and one for the main process): no races


class BadImageError(UsageError):
    """An image that cannot be decoded, with --bad-images fail."""


class ImageFolderDataset(Dataset):
    """Decodes images with PIL; training samples get a random resized crop and flip, validation a
    centre crop. An unreadable file is handled per `bad_images` (module docstring)."""

    def __init__(self, samples: list[tuple[str, int]], classes: list[str], image_size: int,
                 train: bool, bad_images: str = "skip", decoder: str | None = None,
                 on_gpu: bool = False, cpu_share: float = 0.0) -> None:
        if bad_images not in BAD_IMAGE_CHOICES:
            raise UsageError(f"--bad-images {bad_images}: choose skip or fail")
        self.samples, self.classes, self.image_size, self.train = samples, classes, image_size, train
        self.bad_images = bad_images
        # on_gpu: JPEGs leave the workers encoded and are decoded on the device (gpu_images), but
        # for the `cpu_share` of samples (0-1) the workers decode anyway (a hybrid).
        self.on_gpu, self.cpu_share = on_gpu, cpu_share
        self.decoder = decoder or default_decoder()
        self._transform = _torchvision_transform(image_size, train) if self.decoder == "torchvision" else None
        # Shared memory, so counts made in DataLoader workers reach the main process.
        self.bad_counts = torch.zeros(_SLOTS, dtype=torch.int64).share_memory_()
        self._named: set[str] = set()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def bad_count(self) -> int:
        """Unreadable files met so far (each time one is met)."""
        return int(self.bad_counts.sum())

    def __getitem__(self, index: int) -> tuple[torch.Tensor | gpu_images.EncodedImage, torch.Tensor]:
        return self._item(index, self.on_gpu)

    def _item(self, index: int, on_gpu: bool):
        for offset in range(len(self.samples)):
            at = (index + offset) % len(self.samples)
            path, label = self.samples[at]
            try:
                image = (on_gpu and self._encoded(path, at)) or self._read(path)
            except Exception as exc:  # PIL: OSError, SyntaxError, ValueError, DecompressionBombError;
                self._bad(path, exc)  # torchvision: RuntimeError
                continue
            return image, torch.tensor(label, dtype=torch.int64)
        raise UsageError("no image of this split can be read: check the files of --data folder:")

    def _encoded(self, path: str, index: int) -> gpu_images.EncodedImage | None:
        """The file's bytes and this sample's crop, for the device to decode; None when the file
        or the hybrid's share leaves it to the CPU path (gpu_images)."""
        if math.floor((index + 1) * self.cpu_share) > math.floor(index * self.cpu_share):
            return None  # the hybrid's share, spread evenly over the indices
        if Path(path).suffix.lower() not in (".jpg", ".jpeg"):
            return None
        data = gpu_images.read_bytes(path)
        size = gpu_images.gpu_readable(memoryview(data.numpy()))
        if size is None:
            return None
        if self.train:
            box, flip = _random_box(*size), float(torch.rand(1)) < 0.5
        else:
            box, flip = gpu_images.center_box(*size, self.image_size), False
        return gpu_images.EncodedImage(data, box, flip, index)

    collate = staticmethod(gpu_images.collate)

    @property
    def on_device(self):
        """What the prepared loader calls on each batch on the device, ahead of the step (in a
        thread: prefetch_thread), when JPEGs are decoded there; None otherwise."""
        return self._finish_on_device if self.on_gpu else None

    def _finish_on_device(self, batch, device: torch.device):
        """Images still encoded are decoded on `device` (gpu_images.decode_batch)."""
        images, labels = batch
        if isinstance(images, gpu_images.ImageBatch):
            images = gpu_images.decode_batch(images, self.image_size, device, self._replacement)
        return images, labels

    def _replacement(self, index: int, exc: BaseException) -> torch.Tensor:
        """A file the device and PIL both failed on: named and counted (or, with --bad-images
        fail, the end of the run), and the next readable image decoded on the CPU instead."""
        self._bad(self.samples[index][0], exc)
        return self._item(index + 1, on_gpu=False)[0]

    def _read(self, path: str) -> torch.Tensor:
        if self._transform is not None and Path(path).suffix.lower() in _TORCHVISION_SUFFIXES:
            from torchvision.io import ImageReadMode, decode_image, read_file

            return self._transform(decode_image(read_file(path), mode=ImageReadMode.RGB)).contiguous()
        image = _decode(path)
        image = _random_crop(image, self.image_size) if self.train else _center_crop(image, self.image_size)
        return _to_tensor(image)

    def _bad(self, path: str, exc: BaseException) -> None:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self.bad_images == "fail":
            raise BadImageError(f"cannot read image '{path}' ({why}): delete or replace the file, "
                                "or pass --bad-images skip to train without it")
        info = get_worker_info()
        self.bad_counts[(info.id + 1) % _SLOTS if info else 0] += 1
        if path not in self._named:
            self._named.add(path)
            print(f"multigpu: warning: skipped unreadable image '{path}' ({why}); the next image "
                  "of the split takes its place (--bad-images fail to stop instead)",
                  file=sys.stderr, flush=True)


def default_decoder() -> str:
    """"torchvision" where it imports (the faster path, module docstring), else "pil"."""
    try:
        import torchvision.io  # noqa: F401
        import torchvision.transforms.v2  # noqa: F401
    except Exception:  # not installed, or built for another torch ("operator ... does not exist")
        return "pil"
    return "torchvision"


def _torchvision_transform(size: int, train: bool):
    """The PIL path's crops (_random_crop, _center_crop) as torchvision.transforms.v2."""
    from torchvision.transforms import v2

    if train:
        return v2.Compose([v2.RandomResizedCrop(size, scale=(0.35, 1.0), ratio=(3 / 4, 4 / 3), antialias=True),
                           v2.RandomHorizontalFlip()])
    return v2.Compose([v2.Resize(round(size * 8 / 7), antialias=True), v2.CenterCrop(size)])


def _decode(path: str):
    from PIL import Image

    with Image.open(path) as raw:
        return raw.convert("RGB")


def _random_box(width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, width, height) of a random region: 35-100% of the area, aspect 3/4-4/3."""
    area = width * height
    for _ in range(10):
        target = area * float(torch.empty(1).uniform_(0.35, 1.0))
        aspect = math.exp(float(torch.empty(1).uniform_(math.log(3 / 4), math.log(4 / 3))))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(torch.randint(width - w + 1, (1,)))
            top = int(torch.randint(height - h + 1, (1,)))
            return left, top, w, h
    side = min(width, height)  # very elongated image: the largest centred square
    return (width - side) // 2, (height - side) // 2, side, side


def _random_crop(image, size: int):
    """Crop a random region (_random_box), resize it to size x size, maybe flip it (the draws in
    the order the GPU path makes them too)."""
    from PIL import Image

    left, top, w, h = _random_box(*image.size)
    image = image.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if float(torch.rand(1)) < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return image


def _center_crop(image, size: int):
    """The centre region that resizing the shorter side to size * 8/7 (256 for 224) and cutting out
    the centre size x size would keep, resized in one step (gpu_images.center_box: the GPU path
    cuts the same box)."""
    from PIL import Image

    left, top, w, h = gpu_images.center_box(*image.size, size)
    return image.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))


def _to_tensor(image) -> torch.Tensor:
    """uint8 (C, H, W); see DataBundle.normalize."""
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous()


_FOLDER_LAYOUT = "expected PATH/train/<class>/<image> and PATH/val/<class>/<image>"


def _class_images(split_dir: Path) -> dict[str, list[str]]:
    images = {}
    for folder in sorted(p for p in split_dir.iterdir() if p.is_dir()):
        files = sorted(str(f) for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise UsageError(
                f"class folder '{folder}' has no images: add .jpg/.png files to it or remove the folder"
            )
        images[folder.name] = files
    if not images:
        raise UsageError(f"'{split_dir}' has no class folders: {_FOLDER_LAYOUT}")
    return images


def load_folder(path: str, image_size: int, bad_images: str = "skip", decoder: str | None = None) -> DataBundle:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UsageError(f"data folder '{path}' does not exist: check the path in --data folder:{path}")
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise UsageError(f"data folder '{path}' has no {split}/ subfolder: {_FOLDER_LAYOUT}")
    train_images = _class_images(root / "train")
    val_images = _class_images(root / "val")
    classes = list(train_images)
    if len(classes) < 2:
        raise UsageError(f"'{root / 'train'}' has one class folder ({classes[0]}): a classifier "
                         "of one class is always right and learns nothing; add a folder per "
                         f"class: {_FOLDER_LAYOUT}")
    extra = sorted(set(val_images) - set(classes))
    if extra:
        raise UsageError(
            f"'{root / 'val'}' has class folders missing from train/ ({', '.join(extra)}): "
            "val/ must use the same class folders as train/"
        )
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
               deterministic: bool = False) -> str | None:
    """Where folder: JPEGs get decoded (`--decode`), set on both datasets; returns the line that
    says so on a GPU run (None for other data, or on CPUs where there is no choice).

    auto, where nvJPEG works: the workers alone when there are enough of them, else both, the
    workers taking gpu_images.hybrid_share of the images (by index, so a sample's decoder does
    not change within a run); with --deterministic and too few workers the GPU alone, so that a
    run resumed with other workers decodes every image as before."""
    if not isinstance(data.train, ImageFolderDataset):
        return None
    if asked not in DECODE_CHOICES:
        raise UsageError(f"--decode {asked}: choose {', '.join(DECODE_CHOICES)}")
    problem = None if asked == "cpu" else gpu_images.gpu_decode_problem(device)
    if asked == "gpu" and problem:
        raise UsageError(f"--decode gpu: {problem}; use --decode cpu (the loader workers decode) "
                         "or auto")
    on_gpu = asked != "cpu" and problem is None
    share = gpu_images.hybrid_share(workers) if on_gpu and asked == "auto" else 0.0
    if share == 1.0:
        on_gpu, share = False, 0.0
    elif deterministic:
        share = 0.0
    for dataset in (data.train, data.val):
        dataset.on_gpu, dataset.cpu_share = on_gpu, share
    if device.type != "cuda":
        return None
    if on_gpu and share:
        return (f"folder: JPEGs decoded on {device} (nvJPEG) and by {workers} loader workers "
                f"({share:.0%} of them), the GPU's crops there too (--decode gpu|cpu: one of them)")
    if on_gpu:
        return (f"folder: JPEGs decoded on {device} (nvJPEG), the crops there too; {workers} loader "
                "workers read the files (--decode cpu: the workers decode)")
    why = ("--decode cpu" if asked == "cpu" else f"the GPU path is off: {problem}" if problem
           else "enough of them: --decode gpu to use nvJPEG")
    return f"folder: images decoded by {workers} loader workers per GPU ({why})"
