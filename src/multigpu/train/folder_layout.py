"""The layout a `folder:` dataset must have, checked without torch: by `multigpu train` before it
starts anything (a mistyped path costs one line), and by imagefolder.load_folder where it reads."""
from __future__ import annotations

from pathlib import Path

from multigpu.core.errors import UsageError

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
