"""An image folder packed into WebDataset tar shards (`multigpu pack`), bytes unchanged.

Each split (PATH/train, PATH/val) is shuffled with a seeded generator, so that a reader taking
the shards in order does not read one class after another, then cut into shards of about
`shard_size` bytes: SPLIT-000000.tar, ... in OUT. Sample n of a split is the members
`NNNNNNNN_STEM.EXT` (the image's bytes as they are in the folder) and `NNNNNNNN_STEM.cls` (its class
index as text): the key is the sample's place in the shuffled order, then the file's name with
anything but letters, digits, `-` and `_` made `_`, so that webdataset's reader, which takes a
key to end at the first dot, reads it too. OUT/classes.json names the classes and holds the
counts of each class, the shards with their sample counts (as wids' shard index lists them:
url, nsamples) and the seed.

Stopped and started again with the same arguments, it goes on: the plan (which image goes in which
shard) depends only on the folder's files, their sizes and the seed, a shard is written under a
temporary name and renamed once whole, and a shard already in OUT that holds exactly its planned
members is kept. A shard in OUT that is not of this plan is never overwritten: one line says so.
At the end every shard is read back through its index (shard_index, built then): each image of the
folder is in exactly one shard, with its size and label.
"""
from __future__ import annotations

import json
import os
import random
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from multigpu.core.errors import UsageError
from multigpu.core.system.fileio import atomic_write
from multigpu.train.data.folder_layout import check_classes, check_root, class_images
from multigpu.train.data.shard_index import scan, shard_samples

SPLITS = ("train", "val")
_HEADER = tarfile.BLOCKSIZE
_STEM_CHARS = 40  # keys stay well under ustar's 100-character names: no pax header per member


@dataclass(frozen=True)
class Item:
    key: str
    file: str
    label: int
    size: int


def parse_size(text: str) -> int:
    """`1GB`, `500MB`, `1.5GiB`, `4096` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--shard-size {text}: give a size such as 1GB, 500MB or 256MiB")
    base = 1024 if match.group(3) else 1000
    power = " KMGT".index(match.group(2).upper() or " ")
    return max(1, int(float(match.group(1)) * base ** power))


def plan(path: str, seed: int, shard_size: int) -> tuple[list[str], dict[str, list[list[Item]]]]:
    """The classes and, per split, the shards' items in order (module docstring)."""
    root = check_root(path)
    images = {split: class_images(root / split) for split in SPLITS}
    check_classes(root, images["train"], images["val"])
    classes = list(images["train"])
    shards = {}
    for split in SPLITS:
        files = [(f, classes.index(name)) for name, fs in images[split].items() for f in fs]
        random.Random(seed).shuffle(files)
        items = [Item(_key(n, f), f, label, os.path.getsize(f)) for n, (f, label) in enumerate(files)]
        shards[split] = _cut(items, shard_size)
    return classes, shards


def _key(n: int, file: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", Path(file).stem)[:_STEM_CHARS]
    return f"{n:08d}_{stem}"


def _cut(items: list[Item], shard_size: int) -> list[list[Item]]:
    """Shards of about `shard_size` bytes of tar (headers and padding counted), each at least one
    image."""
    shards, current, used = [], [], 0
    for item in items:
        size = 3 * _HEADER + -(-item.size // _HEADER) * _HEADER  # image header and data, label
        if current and used + size > shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(item)
        used += size
    return shards + [current] if current else shards


def pack(path: str, out: Path, seed: int = 0, shard_size: int = 10**9,
         progress: Callable[[int, int], None] = lambda images, total: None) -> dict:
    """Write the shards and classes.json (module docstring); returns classes.json's content.
    `progress(n, total)` is told each n images packed (or found packed already) of `total`."""
    classes, shards = plan(path, seed, shard_size)
    summary = {"classes": classes, "seed": seed, "source": str(Path(path).resolve()),
               "counts": {s: _counts(shards[s], classes) for s in SPLITS},
               "shards": {s: [{"url": _name(s, i), "nsamples": len(items)}
                              for i, items in enumerate(shards[s])] for s in SPLITS}}
    _check_out(out, summary)
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        for number, items in enumerate(shards[split]):
            target = out / _name(split, number)
            if not target.exists():
                atomic_write(target, lambda f, items=items: _write(f, items))
            elif not _holds(target, items):
                raise UsageError(f"--out {out}: {target.name} is there and is not the shard this "
                                 "folder, --seed and --shard-size make; it is left as it is: "
                                 "give an empty folder, or the arguments it was packed with")
            progress(len(items), sum(sum(c.values()) for c in summary["counts"].values()))
    check_packed(out, shards)
    atomic_write(out / "classes.json", lambda f: f.write(json.dumps(summary, indent=1).encode()))
    return summary


def _counts(shards: list[list[Item]], classes: list[str]) -> dict[str, int]:
    """Images of each class in a split."""
    counts = dict.fromkeys(classes, 0)
    for item in (i for items in shards for i in items):
        counts[classes[item.label]] += 1
    return counts


def _name(split: str, number: int) -> str:
    return f"{split}-{number:06d}.tar"


def _check_out(out: Path, summary: dict) -> None:
    """OUT is empty, or holds this packing (stopped, or done): nothing else there is touched."""
    listed = out / "classes.json"
    if listed.is_file():
        try:
            before = json.loads(listed.read_text())
        except ValueError:
            before = None
        if before != summary:
            raise UsageError(f"--out {out} holds a packing of other images or arguments "
                             f"({listed}): give an empty folder; nothing there is replaced")
    elif out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: a file is there, not a folder; give another path")
    planned = {shard["url"] for listed in summary["shards"].values() for shard in listed}
    other = sorted(p.name for s in SPLITS for p in out.glob(f"{s}-*.tar") if p.name not in planned)
    if other:
        raise UsageError(f"--out {out} holds shards this packing does not make ({other[0]}...): "
                         "give an empty folder; nothing there is replaced")


def _write(f, items: list[Item]) -> None:
    with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for item in items:
            suffix = Path(item.file).suffix.lower()
            with open(item.file, "rb") as image:
                tar.addfile(_info(item.key + suffix, item.size), image)
            label = str(item.label).encode()
            tar.addfile(_info(item.key + ".cls", len(label)), _Bytes(label))


def _info(name: str, size: int) -> tarfile.TarInfo:
    """A member with no owner and no time: the same folder packs into the same bytes."""
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o444
    return info


class _Bytes:
    def __init__(self, data: bytes):
        self.data = data

    def read(self, n: int = -1) -> bytes:
        data, self.data = (self.data, b"") if n < 0 else (self.data[:n], self.data[n:])
        return data


def _holds(shard: Path, items: list[Item]) -> bool:
    """Whether a shard already in OUT holds exactly `items` (a stopped pack's whole shard)."""
    try:
        samples = scan(shard)
    except UsageError:  # not a whole tar
        return False
    return [(s.key, s.size, s.label) for s in samples] == [(i.key, i.size, i.label) for i in items]


def check_packed(out: Path, shards: dict[str, list[list[Item]]]) -> None:
    """Every image of the folder in exactly one shard, with its size and label (each shard read
    back through its index, which this builds)."""
    for split, planned in shards.items():
        found: dict[str, list[str]] = {}
        for number, items in enumerate(planned):
            shard = out / _name(split, number)
            samples = shard_samples(shard)
            for s in samples:
                found.setdefault(s.key, []).append(shard.name)
            if [(s.key, s.size, s.label) for s in samples] != [(i.key, i.size, i.label) for i in items]:
                raise UsageError(f"{shard}: its members are not the images planned for it: "
                                 "remove it and pack again")
        want = [i.key for items in planned for i in items]
        twice = [k for k, where in found.items() if len(where) > 1]
        if twice or sorted(found) != sorted(want):
            raise UsageError(f"{out}: the {split} shards do not hold each image once "
                             f"({len(found)} keys of {len(want)}, {len(twice)} twice): remove "
                             "them and pack again")
