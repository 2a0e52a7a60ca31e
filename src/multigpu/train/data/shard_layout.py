"""The shards of a `--data shards:` spec and their classes, checked without torch: by `multigpu
train` before it starts anything (which also builds each shard's index once, shard_index, before
N ranks would each build it), and by shards.load_shards where it reads.

    --data shards:DIR                          DIR/train-*.tar and DIR/val-*.tar
    --data shards:train=PATTERN,val=PATTERN    brace patterns, e.g. train=/d/train-{000000..000099}.tar
"""
from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path

from multigpu.core.errors import UsageError
from multigpu.train.data.shard_index import shard_samples, where_indexed

CLASSES_FILE = "classes.json"
FORMS = "shards:DIR (DIR/train-*.tar and DIR/val-*.tar) or shards:train=PATTERN,val=PATTERN"


def check_label(shard: Path, key: str, label: int, classes: int) -> None:
    if not 0 <= label < classes:
        raise UsageError(f"shard '{shard}': key '{key}' has label {label}, outside 0..{classes - 1} "
                         f"(the {classes} classes of {CLASSES_FILE} or of the training labels): "
                         "labels are the class indices 0..K-1")


def listed(shards: list[Path]) -> str:
    return ", ".join(str(s) for s in shards[:3]) + (" ..." if len(shards) > 3 else "")


def split_shards(arg: str) -> tuple[list[Path], list[Path], Path]:
    """The train and val shards of `shards:ARG` and the folder classes.json is looked for in."""
    if "=" not in arg:
        root = Path(arg).expanduser()
        if not root.is_dir():
            raise UsageError(f"shards folder '{arg}' does not exist: check the path in "
                             f"--data shards:{arg}")
        found = {split: sorted(root.glob(f"{split}-*.tar")) for split in ("train", "val")}
        for split, shards in found.items():
            if not shards:
                raise UsageError(f"shards folder '{arg}' has no {split}-*.tar shard: both splits "
                                 f"are needed, as for folder: (multigpu pack writes them), or "
                                 f"name them: {FORMS}")
        return found["train"], found["val"], root
    parts = dict(_split_top(arg))
    if sorted(parts) != ["train", "val"]:
        raise UsageError(f"--data shards:{arg}: name both splits and nothing else: {FORMS}")
    train, val = (expand_split(parts[split], split) for split in ("train", "val"))
    return train, val, train[0].parent


def _split_top(arg: str):
    """`train=A,val=B` split at the commas outside braces (a brace list has commas of its own)."""
    depth, start = 0, 0
    for i, ch in enumerate(arg + ","):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            name, eq, pattern = arg[start:i].partition("=")
            if not eq or not pattern:
                raise UsageError(f"--data shards:{arg}: {arg[start:i]!r} is not SPLIT=PATTERN: {FORMS}")
            yield name.strip(), pattern.strip()
            start = i + 1


def expand_braces(pattern: str) -> list[str]:
    """`a-{000..002}.tar` -> a-000.tar, a-001.tar, a-002.tar (zero-padded as written);
    `{a,b}` -> a, b; as webdataset's (braceexpand's) patterns, nested and repeated."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    body, head, tail = match.group(1), pattern[:match.start()], pattern[match.end():]
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if span:
        lo, hi = span.groups()
        width = len(lo) if lo.startswith("0") else 0
        choices = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    else:
        choices = body.split(",")
    return [p for c in choices for p in expand_braces(head + c + tail)]


def expand_split(pattern: str, split: str) -> list[Path]:
    paths = []
    for one in expand_braces(os.path.expanduser(pattern)):
        paths += sorted(glob.glob(one)) if glob.has_magic(one) else [one]
    missing = [p for p in paths if not os.path.isfile(p)]
    if not paths or missing:
        raise UsageError(f"{split} shard pattern {pattern!r}: "
                         f"{'no file ' + repr(missing[0]) if missing else 'it matches nothing'} "
                         f"({len(missing)} of {len(paths)} missing): check the pattern")
    return [Path(p) for p in paths]


def class_names(folder: Path, indexed: list) -> list[str]:
    """The names in folder/classes.json, else '0'..'max' of the training labels (`indexed`:
    the training shards' samples, shard by shard)."""
    path = folder / CLASSES_FILE
    if path.is_file():
        try:
            names = json.loads(path.read_text())["classes"]
            if not isinstance(names, list):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"'{path}' has no \"classes\" list: write it as multigpu pack does "
                             '({"classes": ["name", ...]}) or remove it') from None
        return [str(n) for n in names]
    labels = [s.label for samples in indexed for s in samples]
    if min(labels, default=0) < 0:
        raise UsageError(f"the training shards hold label {min(labels)}: labels are the class "
                         "indices 0..K-1")
    names = [str(i) for i in range(max(labels, default=0) + 1)]
    if len(names) < 2:
        raise UsageError(f"the training shards hold one class ({names[0]}): a classifier of one "
                         "class learns nothing; pack images of two classes or more")
    return names


def check_shards(arg: str) -> None:
    """The launcher's check of `--data shards:ARG`: the shards are there and readable, their
    labels right, and their indexes built, once, before N ranks would each build them."""
    train, val, folder = split_shards(arg)
    indexed = {split: [(shard, shard_samples(shard)) for shard in shards]
               for split, shards in (("train", train), ("val", val))}
    classes = len(class_names(folder, [samples for _, samples in indexed["train"]]))
    for split, shards in indexed.items():
        if not any(samples for _, samples in shards):
            raise UsageError(f"the {split} shards {listed([s for s, _ in shards])} hold no images: "
                             "pack images into them (multigpu pack folder:PATH --out DIR)")
        for shard, samples in shards:
            for s in samples:
                check_label(shard, s.key, s.label, classes)


def shard_findings(arg: str):
    """doctor's lines for `--data shards:ARG` (after check_shards passed): what the shards hold,
    and the two things that cost a run something: class names that are only numbers, and indexes
    kept in this machine's cache (the shards' folder cannot be written), which every other node
    without that cache builds again."""
    from multigpu.core.findings import Finding

    train, val, folder = split_shards(arg)
    indexed = [shard_samples(shard) for shard in train]
    classes = class_names(folder, indexed)
    images = sum(len(samples) for samples in indexed), sum(len(shard_samples(s)) for s in val)
    findings = [Finding("ok", "shards", f"{images[0]} train / {images[1]} val images in "
                                        f"{len(train)} + {len(val)} shards, {len(classes)} classes; "
                                        "read at random through their indexes: every sample once "
                                        "an epoch, on any device count")]
    if not (folder / CLASSES_FILE).is_file():
        findings.append(Finding("warn", "shards", f"no {CLASSES_FILE} beside the shards in {folder}: "
                                                  "the classes are named by their indices 0.."
                                                  f"{len(classes) - 1}; write one "
                                                  '({"classes": ["name", ...]}), as multigpu pack does'))
    cached = [s for s in train + val if (where_indexed(s) or s).parent != s.parent]
    if cached:
        findings.append(Finding("warn", "shards", f"{len(cached)} shard indexes are in "
                                                  f"{where_indexed(cached[0]).parent}, not beside "
                                                  "the shards (their folder cannot be written): a "
                                                  "node without that folder reads every tar's "
                                                  "headers again; set MULTIGPU_CACHE_DIR to a "
                                                  "shared folder, or index once where the shards "
                                                  "can be written"))
    return findings
