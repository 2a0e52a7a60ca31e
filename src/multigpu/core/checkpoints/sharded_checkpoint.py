"""Sharded checkpoints: every rank writes its own part of the model and optimizer state with
torch.distributed.checkpoint (DCP); nothing is gathered onto one rank.

    checkpoints/
        step-000000024.pt                 the usual step file, without the model and optimizer
                                          tensors: its "shards" names the folder below and the
                                          size of each of its files
        step-000000024.5f3a9c1e.shards/   DCP's files: .metadata and one __<rank>_0.distcp per
                                          rank; a new name for every save, never reused

Writing (collective): every rank writes into one temporary folder (`.step-....tmp`, a name the
store removes as a leftover); DCP fsyncs each file and writes .metadata last; the ranks check
that they all see the same files (a folder every node shares); rank 0 renames it to its new
name. The step file, written after, lists the files and their sizes, and the manifest lists the
step file and its folder: the checkpoint is complete only then. Folders are removed only once no
listed checkpoint and no best.pt names them (checkpoint_store.py).

Reading: on any number of processes, under any strategy, and in one process without a process
group: DCP cuts what was saved into whatever layout the prepared model and optimizer have
(torch.distributed.checkpoint.state_dict names both by parameter path). `export` turns one
into the single-file checkpoint every other strategy writes.
"""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from multigpu.core.checkpoints import checkpoint
from multigpu.core.system import fileio
from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.core.errors import os_error_text
from multigpu.core.distributed import DistEnv


class _NoCheckpointException(BaseException):
    """Stands for torch's CheckpointException where torch has no distributed checkpoints."""


def _checkpoint_exception() -> type[BaseException]:
    """torch.distributed.checkpoint's CheckpointException, imported only when a sharded
    checkpoint is used (the module costs a worker about 0.4 s of imports: DTensor, sympy)."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:
        return _NoCheckpointException
    return CheckpointException

SUFFIX = schema.SHARDS_SUFFIX
NOT_SHARED = ("the ranks see different files in {folder}: the checkpoint folder must be on a "
              "file system every node shares (NFS, Lustre, ...); give --out such a folder")


def is_shards_name(name: str) -> bool:
    return name.endswith(SUFFIX) and not fileio.is_temp_name(name)


def save(env: DistEnv, beside: Path, stem: str, model: nn.Module, optimizer) -> dict | None:
    """Collective: write `model`'s and `optimizer`'s state, each rank its own shards, into a new
    folder `beside/<stem>.<random>.shards` (never one that exists: a checkpoint written again at
    the same step gets a folder of its own, and the old one stays valid until its step file is
    replaced). Returns {"dir": the folder's name, "files": {name: bytes}} on rank 0, None
    elsewhere. Every rank raises if any rank's part failed."""
    import torch.distributed.checkpoint as dcp

    made = None
    if env.is_main:
        try:
            beside.mkdir(parents=True, exist_ok=True)
            made = (tempfile.mkdtemp(prefix=f".{stem}.", suffix=fileio.TEMP_SUFFIX, dir=beside),
                    f"{stem}.{secrets.token_hex(4)}{SUFFIX}")
        except OSError as exc:
            made = exc
    made = env.broadcast_object(made)
    if isinstance(made, OSError):  # every rank stops here together
        raise made
    tmp, name = Path(made[0]), made[1]
    try:
        try:
            dcp.save(_state(model, optimizer), checkpoint_id=tmp)  # every rank raises if one fails
        except _checkpoint_exception() as exc:  # a BaseException, holding each rank's failure
            raise RuntimeError(_first_failure(exc, tmp)) from None
        seen = env.all_gather_object(sorted(os.listdir(tmp)))
        if any(names != seen[0] for names in seen):
            raise RuntimeError(NOT_SHARED.format(folder=beside))
        done = _put_in_place(tmp, beside / name) if env.is_main else None
        done = env.broadcast_object(done)  # rank 0's result or its error, on every rank
        if isinstance(done, OSError):
            raise done
    except BaseException:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return done if env.is_main else None


def _put_in_place(tmp: Path, folder: Path) -> dict | OSError:
    """Rank 0: the written folder under its new name, durably; what the step file records."""
    try:
        fileio.fsync_dir(tmp)
        os.chmod(tmp, fileio.DIR_MODE)  # mkdtemp's folder is private
        os.replace(tmp, folder)
        fileio.fsync_dir(folder.parent)
        files = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
        return {schema.SHARDS_DIR: folder.name, schema.SHARDS_FILES: files}
    except OSError as exc:
        return exc


def _first_failure(exc: BaseException, folder: Path) -> str:
    """One line for torch.distributed.checkpoint's CheckpointException: its first rank's error
    (each failure is the exception, or the exception and its stack)."""
    failures = getattr(exc, "failures", None) or {}
    for rank, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) and failure else failure
        inner = getattr(inner, "exception", inner)
        if isinstance(inner, OSError) and inner.strerror:
            return f"rank {rank}: {os_error_text(inner)}"
        text = str(inner).strip()
        line = text.splitlines()[0] if text else type(inner).__name__
        if "unexpected pos" in line:  # torch.save's zip writer: fewer bytes reached the file
            return (f"rank {rank}: its shard file was written short ({line}), as on a full disk "
                    f"or past a file size limit; {_free(folder)}")
        return f"rank {rank}: {line}"
    return str(exc).strip().splitlines()[0]


def _free(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**30:.1f} GiB free there now"
    except OSError:
        return "its free space is unknown"


def load(env: DistEnv, folder: Path, files: dict, step_file: Path | str | None,
         model: nn.Module, optimizer=None) -> None:
    """Collective (or one process): fill the prepared `model` (and `optimizer`) from `folder`,
    whose `files` rank 0 checks first (`verify`); every rank then reads its part, or none does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    error = None
    if env.is_main:
        try:
            verify(folder, files, step_file)
        except checkpoint.CheckpointError as exc:
            error = str(exc)
    error = env.broadcast_object(error)
    if error:
        raise checkpoint.CheckpointError(error)

    state = _state(model, optimizer)
    with warnings.catch_warnings():  # one process without a group: torch warns that it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer or [], model_state_dict=state[schema.MODEL],
                   optim_state_dict=state.get(schema.OPTIMIZER, {}))


def verify(folder: Path, files: dict, step_file: Path | str | None = None) -> None:
    """CheckpointError unless every file the step file lists is in `folder`, whole; the message
    names `step_file` (the checkpoint whose shards these are) and what to do."""
    whose = f"{step_file} keeps its model and optimizer in {folder}, but " if step_file else ""
    for name, size in files.items():
        try:
            found = (folder / name).stat().st_size
        except OSError as exc:
            raise checkpoint.CheckpointError(
                f"{whose}its shard {folder / name} cannot be read ({exc.strerror or exc}); a "
                "checkpoint file moved or copied needs its shards folder beside it (or give "
                "the run folder)") from None
        if found != size:
            raise checkpoint.CheckpointError(f"{whose}its shard {folder / name} has {found} "
                                             f"bytes, {size} when it was written: truncated or "
                                             "changed")


def folder_of(state: dict, beside: Path) -> Path | None:
    """The shards folder of a checkpoint read from a file in `beside`; None for a whole one."""
    shards = state.get(schema.SHARDS)
    return beside / shards[schema.SHARDS_DIR] if shards else None


def folder_named_by(path: Path) -> Path | None:
    """The shards folder that the checkpoint file `path` names, if it exists and names one."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # no tensor read
    except Exception:  # no file yet, or not ours: nothing of it to clean up
        return None
    folder = folder_of(state, path.parent) if isinstance(state, dict) else None
    return folder if folder is not None and folder.is_dir() else None


def drop_if_unnamed(folder: Path | None) -> None:
    """Remove `folder` unless a checkpoint file beside it still names it (a copy of an earlier
    save, say): the folder of a file that `rt.save` just replaced."""
    if folder is None or any(folder_named_by(f) == folder for f in folder.parent.glob("*.pt")):
        return
    shutil.rmtree(folder, ignore_errors=True)


def export(state: dict, beside: Path, scratch: Path) -> dict:
    """A checkpoint with shards as the single-file kind: the whole model state under MODEL and
    the optimizer's numbered as `optimizer.state_dict()` numbers it. One process, no GPU; the
    whole state passes through a temporary file in `scratch` (where the export goes)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = folder_of(state, beside)
    verify(folder, state[schema.SHARDS][schema.SHARDS_FILES])
    fd, whole = tempfile.mkstemp(prefix=".export.", suffix=fileio.TEMP_SUFFIX, dir=scratch)
    os.close(fd)
    try:
        dcp_to_torch_save(folder, whole)
        parts = torch.load(whole, map_location="cpu", weights_only=True)
    except (_checkpoint_exception(), OSError) as exc:  # its shards went while they were read
        why = str(exc) if isinstance(exc, OSError) else _first_failure(exc, folder)
        raise checkpoint.CheckpointError(f"the shards in {folder} could not be read ({why})"
                                         ) from None
    finally:
        os.unlink(whole)
    optimizer = parts.get(schema.OPTIMIZER)
    out = {k: v for k, v in state.items() if k != schema.SHARDS}
    out[schema.MODEL] = parts[schema.MODEL]
    out[schema.OPTIMIZER] = checkpoint.numbered_optimizer_state(optimizer) if optimizer else None
    return out


def _state(model: nn.Module, optimizer) -> dict:
    """Model and optimizer state keyed by parameter path, sharded where the model is."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {schema.MODEL: get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {schema.MODEL: model_state, schema.OPTIMIZER: optimizer_state}
