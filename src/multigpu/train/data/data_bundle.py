"""What a data spec loads into (`DataBundle`), and the image constants that the built-in data sets
and the image-folder loader share; datasets.py and imagefolder.py both build bundles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff"})


@dataclass
class DataBundle:
    """Training and validation data plus what a model needs to know about them."""

    train: Dataset
    val: Dataset
    task: str  # "classification" (y: int64 scalar) or "regression" (y: float32 vector)
    input_shape: tuple[int, ...]  # shape of one x
    num_outputs: int  # classes, or regression output size
    name: str
    # folder data: x is uint8 (0-255) and still to be normalised with (mean, std) per channel. The
    # float conversion is left to the GPU: 4x fewer bytes through workers, pinned memory and PCIe.
    normalize: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # regression: (mean, std) per output, float32 vectors of num_outputs; original = y * std + mean
    target_scale: tuple[torch.Tensor, torch.Tensor] | None = None
