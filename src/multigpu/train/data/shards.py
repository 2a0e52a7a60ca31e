"""`shards:` data: images packed unchanged into WebDataset tar shards, read at random through an
index of their offsets (shard_index), so the exact sampler decides the order as for `folder:`.

    --data shards:DIR                          DIR/train-*.tar and DIR/val-*.tar
    --data shards:train=PATTERN,val=PATTERN    brace patterns, e.g. train=/d/train-{000000..000099}.tar

A val split is required, as for `folder:`. Class names come from `classes.json` beside the train
shards (`multigpu pack` writes one: {"classes": [...], ...}), else they are the indices 0..max of
the training labels; a label outside 0..K-1 is refused in one line naming its shard and key.

Everything else is `folder:`'s (ShardDataset is an ImageFolderDataset whose bytes come from a
shard): the crops and flips, `--bad-images skip|fail` (a damaged member is named as
SHARD:MEMBER), the CPU workers' decode and the GPU decoders' (the JPEG's bytes straight from the
shard), `--decode auto`. `ShardedImages` is the same dataset for a script of one's own, to pass to
a DataLoader and `rt.prepare`.

Reads are os.pread on a descriptor each process opens per shard on first use (64 at most at once):
positional reads share no file offset, so forked workers may read through the same shard.
"""
from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import numpy as np
import torch

from multigpu.core.errors import UsageError
from multigpu.train.data.data_bundle import IMAGENET_MEAN, IMAGENET_STD, DataBundle
from multigpu.train.data.imagefolder import ImageFolderDataset
from multigpu.train.data.shard_index import shard_samples
from multigpu.train.data.shard_layout import check_label, class_names, expand_split, listed, split_shards

_OPEN_FILES = 64  # shard descriptors a process keeps open


class ShardDataset(ImageFolderDataset):
    """Images of tar shards: sample i is the i-th image of the shards in order (each shard's in
    its tar's order). `samples` names each as 'SHARD:MEMBER' (what a warning or error says)."""

    bad_fix = "write the shard again (multigpu pack) or pass the shards without it"

    def __init__(self, shards: list[Path], classes: list[str], image_size: int, train: bool,
                 bad_images: str = "skip", decoder: str | None = None, indexed=None) -> None:
        names, where = [], []
        indexed = indexed or [shard_samples(shard) for shard in shards]  # or read already
        for number, (shard, samples) in enumerate(zip(shards, indexed, strict=True)):
            for s in samples:
                check_label(shard, s.key, s.label, len(classes))
                names.append((f"{shard}:{s.member}", s.label))
                where.append((number, s.offset, s.size))
        if not names:
            raise UsageError(f"the shards {listed(shards)} hold no images: pack images into "
                             "them (multigpu pack folder:PATH --out DIR)")
        super().__init__(names, classes, image_size, train, bad_images, decoder)
        self.shards = [str(s) for s in shards]
        self._where = np.asarray(where, dtype=np.int64).reshape(-1, 3)  # shard, offset, size
        self._files: dict[int, int] = {}  # shard number -> descriptor, least recently used first
        self._lock = threading.Lock()  # made here: two finishing threads may read at once
        self._pid = os.getpid()

    def __getstate__(self):
        state = super().__getstate__()
        state["_files"], state["_lock"] = {}, None  # descriptors and locks are this process's own
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._lock = threading.Lock()

    def _data(self, at: int) -> torch.Tensor:
        number, offset, size = (int(v) for v in self._where[at])
        with self._own_lock():  # the GPU path's replacement thread reads too (_fd may close one)
            data = os.pread(self._fd(number), size, offset)
        if len(data) != size:  # the shard shrank since it was indexed
            raise OSError(f"{len(data)} of its {size} bytes are in the shard")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def _own_lock(self) -> threading.Lock:
        if self._pid != os.getpid():  # a forked worker: the parent's descriptors are copies
            for fd in self._files.values():
                os.close(fd)
            self._files, self._lock, self._pid = {}, threading.Lock(), os.getpid()
        return self._lock

    def _fd(self, number: int) -> int:
        """The shard's descriptor, opened on first use; at most _OPEN_FILES at once (a data set
        of thousands of shards would pass the usual limit of 1024 a process, in each worker)."""
        fd = self._files.pop(number, None)
        if fd is None:
            if len(self._files) >= _OPEN_FILES:
                os.close(self._files.pop(next(iter(self._files))))  # the least recently used
            fd = os.open(self.shards[number], os.O_RDONLY)
        self._files[number] = fd  # last: the most recently used
        return fd

    def _opened(self, at: int):
        return _Member(self._data(at).numpy().tobytes(), self.samples[at][0].rpartition(":")[2])


class _Member(io.BytesIO):
    """A member's bytes for PIL, which names what it cannot read by its repr()."""

    def __init__(self, data: bytes, name: str):
        super().__init__(data)
        self.member = name

    def __repr__(self) -> str:
        return repr(self.member)


def load_shards(arg: str, image_size: int, bad_images: str = "skip", decoder: str | None = None) -> DataBundle:
    """The DataBundle of `--data shards:ARG` (module docstring)."""
    train_shards, val_shards, folder = split_shards(arg)
    indexed = [shard_samples(shard) for shard in train_shards]
    classes = class_names(folder, indexed)
    return DataBundle(
        train=ShardDataset(train_shards, classes, image_size, True, bad_images, decoder, indexed),
        val=ShardDataset(val_shards, classes, image_size, False, bad_images, decoder),
        task="classification",
        input_shape=(3, image_size, image_size),
        num_outputs=len(classes),
        name=f"shards:{arg}",
        normalize=(IMAGENET_MEAN, IMAGENET_STD),
    )


class ShardedImages(ShardDataset):
    """A split of WebDataset tar shards as a map-style dataset, for a DataLoader and `rt.prepare`:
    uint8 (3, image_size, image_size) images (a random resized crop and flip with `train`, else a
    centre crop; normalise them on the device, ImageNet's mean and std) and int64 labels.

        train = multigpu.ShardedImages("/data/shards", "train", image_size=224)
        model, loader = rt.prepare(model, DataLoader(train, batch_size=64, shuffle=True,
                                                     num_workers=8))

    `source`: a folder (its SPLIT-*.tar), or a brace pattern or list of shard paths. `classes`:
    the class names, default classes.json beside the shards, else 0..max of their labels.
    """

    def __init__(self, source: str | os.PathLike | list, split: str = "train", *,
                 image_size: int = 224, train: bool | None = None, bad_images: str = "skip",
                 classes: list[str] | None = None) -> None:
        if isinstance(source, (list, tuple)):
            shards = [Path(s) for s in source]
        elif Path(source).is_dir():
            shards = sorted(Path(source).glob(f"{split}-*.tar"))
            if not shards:
                raise UsageError(f"'{source}' has no {split}-*.tar shard: pass the folder the "
                                 "shards are in, or their paths")
        else:
            shards = expand_split(str(source), split)
        indexed = [shard_samples(shard) for shard in shards]
        if classes is None:
            classes = class_names(shards[0].parent, indexed)
        super().__init__(shards, list(classes), image_size,
                         split == "train" if train is None else train, bad_images, None, indexed)
