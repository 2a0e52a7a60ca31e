"""The forms of `--data SPEC`, checked without torch: `multigpu train` refuses a spec it cannot
read before it claims a run folder or starts a worker, and datasets.load_data refuses it with
the same line where it reads.

A path given without its form (`--data ./imgs`) is the usual slip: the line names the form that
reads it (folder: for a folder, timeseries: for a file).
"""
from __future__ import annotations

from pathlib import Path

from multigpu.core.errors import UsageError

SPEC_FORMS = ("digits, synthetic:N (e.g. synthetic:5000), folder:PATH (ImageFolder layout), "
              "shards:DIR (WebDataset tar shards), timeseries:CSV")
IMAGE_FORMS = ("folder", "shards")  # images decoded by imagefolder's dataset (shards: a subclass)


def is_known(spec: str) -> bool:
    """Whether `spec` has one of the forms (its argument is checked where it is read)."""
    kind, sep, arg = spec.partition(":")
    return spec == "digits" or (sep and kind == "synthetic") or bool(
        sep and kind in ("folder", "shards", "timeseries") and arg)


def is_images(spec: str) -> bool:
    """Whether `spec` is image files to decode (folder: or shards:): the decoder, --decode and
    --image-size are theirs."""
    kind, sep, arg = spec.partition(":")
    return bool(sep and arg) and kind in IMAGE_FORMS


def check_spec(spec: str) -> None:
    if not is_known(spec):
        raise unknown_spec(spec)


def unknown_spec(spec: str) -> UsageError:
    """The one line for a spec of no known form: for a path, the form that would read it."""
    path = Path(spec).expanduser() if spec else None
    if path is not None and path.is_dir() and any(path.glob("train-*.tar")):
        return UsageError(f"unknown data spec {spec!r}: it is a folder of tar shards; for "
                          f"WebDataset shards (train-*.tar, val-*.tar) use --data shards:{spec}")
    if path is not None and path.is_dir() and not (path / "train").is_dir():
        return UsageError(f"unknown data spec {spec!r}: it is a folder, but --data folder:PATH reads "
                          f"images from PATH/train/<class>/ (and PATH/val/<class>/), and it has no "
                          f"train/ subfolder: move its class folders under {spec.rstrip('/')}/train/ "
                          f"(some images of each class under val/), then use --data folder:{spec}")
    if path is not None and path.is_dir():
        return UsageError(f"unknown data spec {spec!r}: it is a folder; for images in its "
                          f"train/<class>/ and val/<class>/ use --data folder:{spec} (the forms: "
                          f"{SPEC_FORMS})")
    if path is not None and path.is_file():
        return UsageError(f"unknown data spec {spec!r}: it is a file; for a numeric CSV (a time "
                          f"series) use --data timeseries:{spec} (the forms: {SPEC_FORMS})")
    if "/" in spec or spec.startswith((".", "~")):
        return UsageError(f"unknown data spec {spec!r}: no file or folder is there, and it is not "
                          f"one of the forms: {SPEC_FORMS}")
    return UsageError(f"unknown data spec {spec!r}: use one of {SPEC_FORMS}")
