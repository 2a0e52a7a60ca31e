"""`multigpu export RUN|CHECKPOINT`: one checkpoint as a single .pt file.

A run of `--strategy fsdp` keeps each checkpoint's model and optimizer state in a folder of
shards, one file per rank (torch.distributed.checkpoint). This gathers one into a single file in
the layout every other strategy writes: `torch.load(FILE, weights_only=True)["model"]` is the
model's state dict without wrapper prefixes, loadable into the bare nn.Module, and the file
resumes a run with `multigpu train --resume FILE` on any device count. Runs in one process,
without GPUs. A single-file checkpoint is copied as it is.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.core.system import fileio
from multigpu.core.errors import UsageError

EXAMPLES = """\
examples:
  multigpu export runs/20261125-101500-resnet50-folder            # its newest checkpoint
  multigpu export runs/big/checkpoints/best.pt --out big-best.pt
"""


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("export", help="write a checkpoint (sharded or not) as one .pt file",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="RUN|CHECKPOINT",
                   help="a run folder (its newest readable checkpoint) or a checkpoint file")
    p.add_argument("--out", metavar="FILE.pt",
                   help="where the file goes (default: RUN/export/step-NNNNNNNNN.pt); an existing "
                        "file is not replaced")
    return p


def main(args: argparse.Namespace) -> int:
    from multigpu.core.checkpoints import checkpoint

    given = Path(args.out) if args.out else None
    if given is not None:
        _check_out(given)
    for attempt in range(3):  # a run still training may drop a checkpoint while it is read
        state, path = _newest(args.source)
        if state.get(schema.FROM_STATE_DICT):
            raise UsageError(f"{path} holds weights only ({state[schema.FROM_STATE_DICT]}), not a "
                             "checkpoint of a run: there is nothing to export; torch.load it as it "
                             "is, or train from it with multigpu train --resume")
        out = given or _default_out(path, state)
        _check_out(out)
        try:
            state = _whole(state, path, out.parent)
            break
        except checkpoint.CheckpointError:
            if attempt == 2 or not Path(args.source).is_dir():
                raise
    checkpoint.atomic_save(state, out)
    params = sum(t.numel() for t in state[schema.MODEL].values())
    print(f"{out}: the model ({params:,} values in {len(state[schema.MODEL])} tensors), the optimizer "
          f"and the run's state from {path}; torch.load(path, weights_only=True)['model'] is the "
          "model's state dict")
    return 0


def _newest(source: str):
    from multigpu.core import console
    from multigpu.train.checkpoints.runstate import load_source

    return load_source(source, console.warn, flag="export")  # shards verified too


def _whole(state: dict, path: Path, scratch: Path) -> dict:
    from multigpu.core.checkpoints import sharded_checkpoint

    if not state.get(schema.SHARDS):
        return state
    scratch.mkdir(parents=True, exist_ok=True)
    return sharded_checkpoint.export(state, path.parent, scratch)


def _check_out(out: Path) -> None:
    if out.suffix != ".pt":
        raise UsageError(f"--out {out}: a checkpoint file ends in .pt; give a name like model.pt")
    if out.exists():
        raise UsageError(f"{out} already exists; multigpu does not replace your files: choose "
                         "another name with --out")
    fileio.check_can_make(out, "--out", file=True)


def _default_out(path: Path, state: dict) -> Path:
    step = int(state.get(schema.STEP, 0))
    return schema.run_folder_of(path) / "export" / schema.step_file_name(step)
