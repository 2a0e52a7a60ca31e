"""A tar shard made random-access: the byte offset and size of each sample's image and its label,
read once from the tar's headers and kept in an index file, so that multigpu's exact sampler (not
the tar's order) decides which sample a rank reads next.

The shard is WebDataset's layout: members `KEY.jpg` (or .png, any of IMAGE_SUFFIXES) with
`KEY.cls` (the class index as text) or `KEY.json` (an object whose "label" field, or else "cls",
is the class index), as the `webdataset` library's TarWriter or `tar` itself writes them. KEY is
the member's name without its last suffix, so keys may hold dots and sub-folders
(`a/b.v2.jpg` and `a/b.v2.cls` are the key `a/b.v2`). A shard whose tar is cut short, a member
without a label, a label that is not an integer: one line (UsageError) naming the shard and key.

The index file is JSON, beside the shard as `SHARD.idx.json`, or, where the shard's folder cannot
be written, in `$MULTIGPU_CACHE_DIR` (default ~/.cache/multigpu) under shard-index/ named by the
shard's absolute path. It holds the shard's size and modification time: a shard rewritten or
copied again is indexed again. It is written to a temporary file and renamed into place
(fileio.atomic_write), so ranks or loader workers building it at once each put a whole one there.

Why not webdataset's own `wids` index: wids (gone from webdataset 1.0) kept a shard's index as a
pickle beside it (`SHARD.index`): loading a pickle runs whatever code is in it, which a data folder
shared on a cluster must not, it was not keyed on the shard's size or time (a stale index
read wrong bytes), and was written in place (a crash left half a file). Its offsets are the same
tarfile `offset_data` and `size` this index holds.
"""
from __future__ import annotations

import hashlib
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from multigpu.core.errors import UsageError
from multigpu.core.system.fileio import atomic_write
from multigpu.train.data.data_bundle import IMAGE_SUFFIXES

FORMAT, VERSION = "multigpu-shard-index", 1
INDEX_SUFFIX = ".idx.json"
LABEL_SUFFIXES = (".cls", ".json")
JSON_LABEL_FIELDS = ("label", "cls")
_BLOCK = tarfile.BLOCKSIZE


@dataclass(frozen=True)
class Sample:
    """One sample of a shard: its key, its image member's name, where the image's bytes lie in
    the shard, and its label."""

    key: str
    member: str
    offset: int
    size: int
    label: int


def shard_samples(shard: Path) -> list[Sample]:
    """The samples of `shard`, in the tar's order: from its index, built first if none is valid."""
    stat = _stat(shard)
    for place in index_places(shard):
        samples = _read_index(place, stat)
        if samples is not None:
            return samples
    samples = scan(shard)
    _write_index(shard, stat, samples)
    return samples


def where_indexed(shard: Path) -> Path | None:
    """The valid index of `shard` (beside it or in the cache folder), or None."""
    stat = _stat(shard)
    return next((place for place in index_places(shard) if _read_index(place, stat) is not None), None)


def index_places(shard: Path) -> list[Path]:
    """Where the index of `shard` may be: beside it, then in the cache folder."""
    name = hashlib.sha256(str(shard.resolve()).encode()).hexdigest()[:32]
    cache = Path(os.environ.get("MULTIGPU_CACHE_DIR") or Path.home() / ".cache" / "multigpu")
    return [shard.with_name(shard.name + INDEX_SUFFIX), cache / "shard-index" / f"{name}.json"]


def _stat(shard: Path) -> os.stat_result:
    try:
        return shard.stat()
    except OSError as exc:
        raise UsageError(f"shard '{shard}' cannot be read ({exc.strerror}): check the path in "
                         "--data shards:") from None


def _read_index(place: Path, stat: os.stat_result) -> list[Sample] | None:
    try:
        index = json.loads(place.read_text())
    except (OSError, ValueError):
        return None
    if (index.get("format"), index.get("version")) != (FORMAT, VERSION) or \
            (index.get("size"), index.get("mtime_ns")) != (stat.st_size, stat.st_mtime_ns):
        return None  # another program's file, or the shard changed since: indexed again
    return [Sample(*row) for row in index["samples"]]


def _write_index(shard: Path, stat: os.stat_result, samples: list[Sample]) -> None:
    text = json.dumps({"format": FORMAT, "version": VERSION, "shard": shard.name,
                       "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                       "fields": ["key", "member", "offset", "size", "label"],
                       "samples": [[s.key, s.member, s.offset, s.size, s.label] for s in samples]})
    for place in index_places(shard):
        try:
            atomic_write(place, lambda f: f.write(text.encode()))
            return
        except OSError:  # a read-only data folder: the cache folder next
            continue
    # Nowhere to keep it: the samples are still right, read again by the next run.


def scan(shard: Path) -> list[Sample]:
    """Read the tar's headers (and its small label members) once: every sample's image offset,
    size and label; a broken shard is refused in one line."""
    images: dict[str, tarfile.TarInfo] = {}
    labels: dict[str, int] = {}
    try:
        with tarfile.open(shard, mode="r:") as tar:
            for member in tar:
                if member.isfile():
                    _take(tar, shard, member, images, labels)
            end = tar.offset
    except tarfile.TarError as exc:
        if not _ends_whole(shard):  # what tarfile met is the cut, whatever it calls it
            raise _truncated(shard, f"it ends without its end-of-archive blocks; tarfile: {exc}") from None
        raise UsageError(f"shard '{shard}' is not a readable tar ({exc}): write it again "
                         "(multigpu pack, or webdataset's TarWriter)") from None
    _check_whole(shard, images, end)
    missing = [key for key in images if key not in labels]
    if missing:
        raise UsageError(f"shard '{shard}': member '{images[missing[0]].name}' has no label "
                         f"({missing[0]}.cls or {missing[0]}.json){_more(missing)}: every image "
                         "needs its class index beside it, as WebDataset's layout has it")
    unlabelled = [key for key in labels if key not in images]
    if unlabelled:
        raise UsageError(f"shard '{shard}': key '{unlabelled[0]}' has a label and no image "
                         f"(.jpg, .png, ...){_more(unlabelled)}: add its image or remove the label")
    return [Sample(key, m.name, m.offset_data, m.size, labels[key]) for key, m in images.items()]


def _more(keys: list[str]) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


def _take(tar: tarfile.TarFile, shard: Path, member: tarfile.TarInfo, images: dict, labels: dict) -> None:
    key, suffix = os.path.splitext(member.name)
    suffix = suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        if key in images:
            raise UsageError(f"shard '{shard}': key '{key}' has two images ({images[key].name} and "
                             f"{member.name}): give each sample one image")
        images[key] = member
    elif suffix in LABEL_SUFFIXES and (suffix == ".cls" or key not in labels):
        labels[key] = _label(shard, member, tar.extractfile(member).read())


def _label(shard: Path, member: tarfile.TarInfo, data: bytes) -> int:
    """The class index a .cls (text) or .json member holds."""
    where = f"shard '{shard}': label member '{member.name}'"
    try:
        text = data.decode("utf-8").strip()
        value = json.loads(text) if member.name.endswith(".json") else text
    except (UnicodeDecodeError, ValueError):
        raise UsageError(f"{where} is not UTF-8 text or JSON: write the class index as text "
                         "in KEY.cls") from None
    if isinstance(value, dict):
        field = next((f for f in JSON_LABEL_FIELDS if f in value), None)
        if field is None:
            raise UsageError(f"{where} has no \"label\" or \"cls\" field: put the class index "
                             "in one of them")
        value = value[field]
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    raise UsageError(f"{where} holds {str(value)[:40]!r}, not a class index: labels are the "
                     "integers 0..K-1")


def _check_whole(shard: Path, images: dict[str, tarfile.TarInfo], end: int) -> None:
    """A tar cut short (a copy stopped, a full disk) ends where tarfile stops reading, silently:
    its last member runs past the file's end, or the end-of-archive block is missing."""
    size = shard.stat().st_size
    cut = next((m for m in images.values() if m.offset_data + m.size > size), None)
    with open(shard, "rb") as f:
        f.seek(end)
        marker = f.read(_BLOCK)
    if cut is not None or marker != bytes(_BLOCK):
        where = f"member '{cut.name}' ends past the file's {size} bytes" if cut else \
            f"it has no end-of-archive block after byte {end}"
        raise _truncated(shard, where)


def _ends_whole(shard: Path) -> bool:
    """A whole tar ends with two zero blocks (tar and tarfile pad to them); a cut one with data."""
    with open(shard, "rb") as f:
        f.seek(max(0, shard.stat().st_size - 2 * _BLOCK))
        return f.read() == bytes(2 * _BLOCK)


def _truncated(shard: Path, why: str) -> UsageError:
    return UsageError(f"shard '{shard}' is truncated ({why}): copy it again or write it again "
                      "(multigpu pack)")
