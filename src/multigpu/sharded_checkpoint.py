"""Sharded checkpoints: every rank writes its own part of the model and optimizer state with
torch.distributed.checkpoint (DCP); nothing is gathered onto one rank.

    checkpoints/
        step-000000024.pt        the usual step file, without the model and optimizer tensors:
                                 its "shards" names the folder below and the size of each file
        step-000000024.shards/   DCP's files: .metadata and one __<rank>_0.distcp per rank

Writing (collective): every rank writes into one temporary folder (`.step-....shards.<random>.tmp`,
a name the store removes as a leftover), DCP fsyncs each file and writes .metadata last; rank 0
then renames the folder into place. The step file, written after, lists the files and their
sizes, and the manifest lists the step file: the checkpoint is complete only then.

Reading: on any number of processes, under any strategy, and in one process without a process
group: DCP cuts what was saved into whatever layout the prepared model and optimizer have
(torch.distributed.checkpoint.state_dict names both by parameter path). `export` turns one
into the single-file checkpoint every other strategy writes.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from multigpu import checkpoint, fileio
from multigpu.distributed import DistEnv

SUFFIX = ".shards"


def shards_name(step_file: str) -> str:
    """'step-000000024.shards' for 'step-000000024.pt'."""
    return step_file.removesuffix(".pt") + SUFFIX


def save(env: DistEnv, folder: Path, model: nn.Module, optimizer) -> dict | None:
    """Collective: write `model`'s and `optimizer`'s state, each rank its own shards, as
    `folder`. Returns {"dir": folder's name, "files": {name: bytes}} on rank 0, None elsewhere.
    A folder of that name already there is replaced."""
    import torch.distributed.checkpoint as dcp

    tmp = None
    if env.is_main:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=fileio.TEMP_SUFFIX,
                               dir=folder.parent)
    tmp = Path(env.broadcast_object(tmp))
    try:
        dcp.save(_state(model, optimizer), checkpoint_id=tmp)  # raises on every rank if one fails
    except BaseException:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not env.is_main:
        return None
    _replace_folder(tmp, folder)
    return {"dir": folder.name, "files": {p.name: p.stat().st_size for p in sorted(folder.iterdir())}}


def load(folder: Path, model: nn.Module, optimizer=None) -> None:
    """Every rank (or one process): fill the prepared `model` (and `optimizer`) from `folder`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer or [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))


def verify(folder: Path, files: dict) -> None:
    """CheckpointError unless every file the step file lists is in `folder`, whole."""
    for name, size in files.items():
        try:
            found = (folder / name).stat().st_size
        except OSError as exc:
            raise checkpoint.CheckpointError(f"its shard {folder / name} cannot be read "
                                             f"({exc.strerror or exc})") from None
        if found != size:
            raise checkpoint.CheckpointError(f"its shard {folder / name} has {found} bytes, "
                                             f"{size} when it was written: truncated or changed")


def folder_of(state: dict, beside: Path) -> Path | None:
    """The shards folder of a checkpoint read from a file in `beside`; None for a whole one."""
    shards = state.get("shards")
    return beside / shards["dir"] if shards else None


def export(state: dict, beside: Path) -> dict:
    """A checkpoint with shards as the single-file kind: the whole model state under "model" and
    the optimizer's numbered as `optimizer.state_dict()` numbers it. One process, no GPU."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = folder_of(state, beside)
    verify(folder, state["shards"]["files"])
    with tempfile.TemporaryDirectory(dir=beside) as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(folder, whole)
        parts = torch.load(whole, map_location="cpu", weights_only=True)
    optimizer = parts.get("optimizer")
    out = {k: v for k, v in state.items() if k != "shards"}
    out["model"] = parts["model"]
    out["optimizer"] = checkpoint.numbered_optimizer_state(optimizer) if optimizer else None
    return out


def _state(model: nn.Module, optimizer) -> dict:
    """Model and optimizer state keyed by parameter path, sharded where the model is."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _replace_folder(tmp: Path, folder: Path) -> None:
    """Put `tmp` in place of `folder` (renamed away first when it exists; folders cannot be
    replaced in one rename), durably."""
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.{os.getpid()}.old{fileio.TEMP_SUFFIX}")
        os.replace(folder, old)
    os.chmod(tmp, fileio.DIR_MODE)  # mkdtemp's folder is private
    os.replace(tmp, folder)
    fileio.fsync_dir(folder.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
