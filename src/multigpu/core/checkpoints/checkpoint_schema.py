"""What a checkpoint holds and where a run keeps it: every key, file name and format version, in
one place, and one reader per format version.

A checkpoint is one dict, saved with torch.save and read with weights_only=True:

    FORMAT       the layout's version, FORMAT_VERSION when written now
    MODEL        the model's whole state dict, bare keys (None when SHARDS holds it)
    OPTIMIZER    `optimizer.state_dict()`'s layout, or None
    SCHEDULER    the scheduler's state, or None
    PRECISION    the precision's state (the GradScaler's)
    RNG          every rank's RNG state, in rank order
    WORLD_SIZE, STRATEGY   what saved it
    SHARDS       with sharded state: {SHARDS_DIR: the folder beside the file, SHARDS_FILES: {name:
                 bytes}}; that folder keys its torch.distributed.checkpoint state under MODEL and
                 OPTIMIZER as well
    ...          `rt.save`'s extra values, under the caller's names

and a checkpoint of `multigpu train` also:

    RUN          where the run stood (RunState.summary(): RUN_FIELDS)
    EPOCH, STEP, BEST   the completed epochs, the global step and the best score, as format 1
                 had them (an older multigpu resumes from them)
    METRICS      the last finished epoch's record; CONFIG the resolved settings
    DECODE       --decode auto's pick and the rates it was made from (decode_choice), or None
                 before it is made; a resume uses it instead of measuring again

Format versions (a new one whenever the layout changes, with its reader below):
    1  RUN may be missing: a checkpoint saved at an epoch's end by an early multigpu, whose
       EPOCH/STEP/BEST are then where the run stood; `rt.save` files
    2  a checkpoint of `multigpu train` always has RUN
Reading any version returns the current layout, so every checkpoint ever written still loads;
a newer version than this multigpu knows is refused in one line that says to upgrade.

A run folder keeps its checkpoints under CHECKPOINTS (checkpoint_store.py): step files named
by `step_file_name`, LAST_FILE and BEST_FILE as second names, MANIFEST_FILE listing them
(its own format: MANIFEST_FORMAT), and shard folders ending in SHARDS_SUFFIX.

Torch-free: the launching process and the tools read these names without importing torch.
"""
from __future__ import annotations

import re
from pathlib import Path

from multigpu.core.errors import UsageError

FORMAT_VERSION = 2

# --- the checkpoint's keys ---------------------------------------------------------------------
FORMAT = "format"
MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
PRECISION = "precision"
RNG = "rng"
WORLD_SIZE = "world_size"
STRATEGY = "strategy"
SHARDS = "shards"
SHARDS_DIR, SHARDS_FILES = "dir", "files"
RUN = "run"
EPOCH, STEP, BEST = "epoch", "step", "best"
METRICS = "metrics"
CONFIG = "config"
DECODE = "decode"
# the fields of RUN (RunState's, the rng aside); a test holds the two equal
RUN_FIELDS = ("epoch", "position", "global_step", "loss_sum", "seconds", "best")

# A model's bare state dict given where a checkpoint goes (checkpoint.as_checkpoint) is read as
# {MODEL: its weights, FROM_STATE_DICT: where in the file they were}; other scripts' files often
# keep one under one of STATE_DICT_KEYS.
FROM_STATE_DICT = "from_state_dict"
STATE_DICT_KEYS = (MODEL, "state_dict", "model_state_dict")

# --- a run folder's checkpoint files -----------------------------------------------------------
CHECKPOINTS = "checkpoints"
LAST_FILE, BEST_FILE = "last.pt", "best.pt"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
MANIFEST_CHECKPOINTS, MANIFEST_BEST = "checkpoints", "best"  # its entries; best.pt's entry
SHARDS_SUFFIX = ".shards"
_STEP_FILE = re.compile(r"step-(\d+)\.pt")


class CheckpointError(UsageError):
    """A checkpoint that cannot be read: missing, truncated, corrupt, or refused as unsafe."""


class NewerFormatError(CheckpointError):
    """A checkpoint or manifest of a format this multigpu does not know: written by a newer one.
    Never skipped as damaged: an older multigpu must not go on from an older checkpoint."""


def step_file_name(global_step: int) -> str:
    return f"step-{global_step:09d}.pt"


def step_of(name: str) -> int | None:
    """The global step a step file's name holds; None for any other name."""
    found = _STEP_FILE.fullmatch(name)
    return int(found.group(1)) if found else None


def checkpoints_folder(run_folder: Path) -> Path:
    return Path(run_folder) / CHECKPOINTS


def run_folder_of(checkpoint_file: Path) -> Path:
    """The run folder a checkpoint file belongs to: above its folder when that is a run's
    CHECKPOINTS, else the folder the file lies in."""
    return run_folder(Path(checkpoint_file).parent)


def run_folder(folder: Path) -> Path:
    """The run folder of `folder`: its parent when `folder` is a run's CHECKPOINTS, else itself."""
    folder = Path(folder)
    return folder.parent if folder.name == CHECKPOINTS else folder


def completed_epochs(run: dict) -> int:
    """The epochs a run had finished, from its RUN (or a manifest entry's run)."""
    return int(run["epoch"]) - 1


# --- reading: one reader per version ----------------------------------------------------------

def is_checkpoint(obj) -> bool:
    """Whether `obj` (what torch.load returned) is a multigpu checkpoint, of any version."""
    return isinstance(obj, dict) and FORMAT in obj and (MODEL in obj or SHARDS in obj)


def read(state: dict, where: str) -> dict:
    """`state` (a multigpu checkpoint of any version) in the current layout: a new dict, `state`
    itself left as it was. A version this multigpu does not know: NewerFormatError, naming
    `where` (the file) and the fix."""
    version = state.get(FORMAT)
    reader = _READERS.get(version) if type(version) is int else None
    if reader is None:
        raise _unknown(where, "checkpoint", version, FORMAT_VERSION)
    return {**reader(state), FORMAT: FORMAT_VERSION}


def _read_1(state: dict) -> dict:
    """Format 1. Without RUN (saved at an epoch's end), EPOCH/STEP/BEST say where the run stood:
    EPOCH epochs done, the next one from its start."""
    if RUN in state or EPOCH not in state:
        return dict(state)
    run = {"epoch": int(state[EPOCH]) + 1, "position": 0, "global_step": int(state.get(STEP, 0)),
           "loss_sum": 0.0, "seconds": 0.0, "best": state.get(BEST)}
    return {**state, RUN: run}


def _read_2(state: dict) -> dict:
    return dict(state)


_READERS = {1: _read_1, 2: _read_2}


def read_manifest(manifest: dict, where: str) -> dict:
    """A manifest (checkpoint_store.py) as read from `where`; NewerFormatError for a format
    this multigpu does not know."""
    version = manifest.get(FORMAT, MANIFEST_FORMAT) if isinstance(manifest, dict) else None
    if version != MANIFEST_FORMAT:
        raise _unknown(where, "manifest", version, MANIFEST_FORMAT)
    return manifest


def _unknown(where: str, what: str, version, newest: int) -> CheckpointError:
    """A newer version: NewerFormatError, with the fix. Any other: the file is damaged."""
    known = f"format 1 to {newest}" if newest > 1 else "format 1"
    if isinstance(version, int) and not isinstance(version, bool) and version > newest:
        return NewerFormatError(f"{where}: {what} format {version} was written by a newer "
                                f"multigpu (this one reads {known}); upgrade multigpu "
                                "(pip install -U multigpu) to read it")
    return CheckpointError(f"{where}: {what} format {version!r} is not one multigpu wrote (it "
                           f"reads {known}): damaged, or not multigpu's")
