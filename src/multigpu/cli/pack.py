"""`multigpu pack folder:PATH --out DIR`: an image folder as WebDataset tar shards for `--data shards:DIR`.

The images' bytes are packed unchanged, each split shuffled with --seed, in shards of about
--shard-size; DIR/classes.json names the classes. Stopped, the same command goes on where it
was; at the end every image is checked to be in exactly one shard (multigpu.train.data.shard_pack).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from multigpu.core.errors import UsageError
from multigpu.core.system.fileio import check_can_make

EXAMPLES = """\
examples:
  multigpu pack folder:./imgs --out ./shards                    # shards of about 1 GB
  multigpu pack folder:./imgs --out ./shards --shard-size 256MB
  multigpu train --model resnet50 --data shards:./shards --devices 4
"""


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("pack", help="pack an image folder into tar shards (--data shards:)",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="folder:PATH",
                   help="the image folder: PATH/train/<class>/ and PATH/val/<class>/")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the folder the shards and classes.json go to (empty, or a stopped "
                        "pack's: it goes on)")
    p.add_argument("--shard-size", default="1GB", metavar="SIZE",
                   help="bytes a shard holds about (e.g. 1GB, 256MB; default 1GB)")
    p.add_argument("--seed", type=int, default=0, help="the shuffled order's seed (default 0)")
    return p


def main(args: argparse.Namespace) -> int:
    from multigpu.train.data import shard_pack

    kind, _, path = args.source.partition(":")
    if kind != "folder" or not path:
        raise UsageError(f"multigpu pack {args.source}: give the image folder as folder:PATH, "
                         f"e.g. multigpu pack folder:{args.source if not path else path} --out DIR")
    size = shard_pack.parse_size(args.shard_size)
    out = Path(args.out)
    check_can_make(out, "--out")  # /proc/x, a file on the way: one line before any image is read
    with _Bar() as bar:
        summary = shard_pack.pack(path, out, seed=args.seed, shard_size=size, progress=bar.advance)
    counts, shards = summary["counts"], summary["shards"]
    images = {split: sum(counts[split].values()) for split in counts}
    print(f"packed {images['train']} train and {images['val']} val images of "
          f"{len(summary['classes'])} classes into {len(shards['train'])} + {len(shards['val'])} "
          f"shards in {out} (each image in exactly one shard: checked); train with "
          f"--data shards:{out}")
    return 0


class _Bar:
    """A progress bar of the images packed, on a terminal only (rich draws none elsewhere)."""

    def __enter__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        self.progress = Progress(TextColumn("packing"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), console=console, transient=True) \
            if console.is_terminal else None  # elsewhere it would leave an empty line
        if self.progress is not None:
            self.task = self.progress.add_task("packing", total=None)
            self.progress.start()
        return self

    def advance(self, images: int, total: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, total=total, advance=images)

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()
