"""The layout a `folder:` dataset must have, checked without torch: by `multigpu train` before it
starts anything (a mistyped path costs one line), and by imagefolder.load_folder where it reads."""
from __future__ import annotations

import os
from pathlib import Path

from multigpu.core.errors import UsageError
from multigpu.train.data.data_bundle import IMAGE_SUFFIXES

LAYOUT = "expected PATH/train/<class>/<image> and PATH/val/<class>/<image>"


def check_root(path: str) -> Path:
    """The folder of `--data folder:PATH`, with its train/ and val/ subfolders, or a UsageError."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UsageError(f"data folder '{path}' does not exist: check the path in --data folder:{path}")
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise UsageError(f"data folder '{path}' has no {split}/ subfolder: {LAYOUT}")
    return root


def class_images(split_dir: Path, first_only: bool = False) -> dict[str, list[str]]:
    """Each class folder's images, sorted; `first_only`: its first image met (a check)."""
    images = {}
    for folder in sorted(p for p in split_dir.iterdir() if p.is_dir()):
        with os.scandir(folder) as entries:  # file types from the listing: no stat per file
            found = (e.path for e in entries
                     if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES)
            files = [f for f in [next(found, None)] if f] if first_only else sorted(found)
        if not files:
            raise UsageError(
                f"class folder '{folder}' has no images: add .jpg/.png files to it or remove the folder"
            )
        images[folder.name] = files
    if not images:
        raise UsageError(f"'{split_dir}' has no class folders: {LAYOUT}")
    return images


def check_folder(path: str) -> None:
    """The layout of `--data folder:PATH` as load_folder checks it, reading one image name per
    class folder: the launcher's check, before N workers list the whole folder."""
    root = check_root(path)
    check_classes(root, class_images(root / "train", first_only=True),
                   class_images(root / "val", first_only=True))


def check_classes(root: Path, train_images: dict, val_images: dict) -> None:
    classes = list(train_images)
    if len(classes) < 2:
        raise UsageError(f"'{root / 'train'}' has one class folder ({classes[0]}): a classifier "
                         "of one class is always right and learns nothing; add a folder per "
                         f"class: {LAYOUT}")
    extra = sorted(set(val_images) - set(classes))
    if extra:
        raise UsageError(
            f"'{root / 'val'}' has class folders missing from train/ ({', '.join(extra)}): "
            "val/ must use the same class folders as train/"
        )
