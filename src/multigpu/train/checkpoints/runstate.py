"""Where a run stands, as one value, and the one decision of where a run resumes from.

`RunState` is everything besides the weights, optimizer, scheduler and precision that a run needs
to go on exactly: the epoch in progress, the position in that epoch's sample order, the partial
train-loss sum, the best score so far, and every rank's RNG. Every checkpoint holds one.

`resume_point()` is called on every rank and decided on rank 0 alone: rank 0 finds the newest
readable checkpoint (the run folder's own first: after an automatic restart, or when the same
command is run again; then the one --resume names), loads it, and broadcasts it. Other ranks
never read the disk, so ranks on machines without a shared filesystem cannot diverge.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable

from multigpu.core.checkpoints import checkpoint
from multigpu.core import console
from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.train.checkpoints.checkpoint_store import CheckpointStore, verify_and_load
from multigpu.core.distributed import DistEnv
from multigpu.core.errors import UsageError
from multigpu.train.rundir.runfolder import is_run_folder, missing_resume


@dataclass
class RunState:
    epoch: int = 1             # the epoch in progress, 1-based
    position: int = 0          # samples of this epoch's order already trained (on any world size)
    global_step: int = 0       # batches trained since the start of the run
    loss_sum: float = 0.0      # this epoch's train loss summed over its trained samples
    seconds: float = 0.0       # this epoch's training time so far
    best: float | None = None  # best validation score so far (higher is better)
    rng: list = field(default_factory=list, repr=False)  # each rank's RNG state, rank order

    @property
    def completed_epochs(self) -> int:
        return self.epoch - 1

    def summary(self) -> dict:
        """The JSON-able part (the checkpoint manifest lists it)."""
        return {k: v for k, v in asdict(self).items() if k != "rng"}

    def to_checkpoint(self) -> dict:
        """The checkpoint's keys for this state (the RNG goes in as the checkpoint's RNG).
        EPOCH/STEP/BEST also as format 1 had them, for an older multigpu (checkpoint_schema)."""
        return {schema.RUN: self.summary(), schema.EPOCH: self.completed_epochs,
                schema.STEP: self.global_step, schema.BEST: self.best}

    @classmethod
    def from_checkpoint(cls, state: dict) -> RunState:
        """Of a checkpoint in the current format (checkpoint_schema.read: an early multigpu's
        has its RUN made from its epoch). Without RUN (a model's weights alone, an `rt.save`
        file) the run starts at its beginning."""
        return cls(**state.get(schema.RUN, {}), rng=list(state.get(schema.RNG) or []))


@dataclass
class ResumePoint:
    state: dict          # the whole checkpoint
    path: str            # where rank 0 read it
    in_place: bool       # it is the run folder's own (so its metrics.jsonl goes on)

    @property
    def run(self) -> RunState:
        return RunState.from_checkpoint(self.state)

    @property
    def weights_only(self) -> str | None:
        """What the file held when it is a model's bare state dict (checkpoint.as_checkpoint):
        the run trains from its weights, from epoch 1, with a fresh optimizer."""
        return self.state.get(schema.FROM_STATE_DICT)


def starts_fresh(out: Path, resume: str | None) -> bool:
    """Whether the run begins at its first step: no --resume and no checkpoint of its own, so
    that resume_point will find nothing (the folder is the run's, claimed: nothing else writes
    checkpoints there meanwhile). Where it is True the run starts its loader workers early."""
    return not resume and not CheckpointStore(schema.checkpoints_folder(out)).has_checkpoints()


def resume_point(env: DistEnv, out: Path, resume: str | None, keep: int) -> ResumePoint | None:
    """Decided on rank 0 and broadcast (a collective: call it on every rank)."""
    decision = None
    if env.is_main:
        try:
            decision = _find(out, resume, keep, console.warn)
        except UsageError as exc:
            decision = exc
    decision = env.broadcast_object(decision)
    if isinstance(decision, UsageError):
        raise decision
    return decision


def _find(out: Path, resume: str | None, keep: int,
          warn: Callable[[str], None]) -> ResumePoint | None:
    own = CheckpointStore(schema.checkpoints_folder(out), keep)
    if own.has_checkpoints():  # this run's own newest: a restart, or the same command again
        found = own.load_newest(warn)
        if found:
            return ResumePoint(found[0], str(found[1]), in_place=True)
    if not resume:
        return None
    state, path = load_source(resume, warn)
    return ResumePoint(state, str(path), in_place=_same(schema.run_folder_of(path), out))


def load_source(resume: str, warn: Callable[[str], None] = lambda _: None,
                flag: str = "--resume") -> tuple[dict, Path]:
    """The checkpoint --resume names (a file, or a run folder's newest readable one), loaded; a
    one-line UsageError when there is none. A file may also be a model's bare state dict
    (checkpoint.as_checkpoint). The CLI calls it before it makes a run folder.
    `flag`: how the messages name the argument."""
    path = Path(resume)
    if path.is_dir():
        inside = schema.checkpoints_folder(path)
        store = CheckpointStore(inside if inside.is_dir() else path)
        found = store.load_newest(warn) if store.has_checkpoints() else None
        if not found:
            raise UsageError(f"{flag} {resume}: {_why_no_checkpoint(path, inside)}")
        return found
    if not path.is_file():
        raise missing_resume(resume, flag)
    listed = {e.file: e for e in CheckpointStore(path.parent).entries()}
    try:
        state = verify_and_load(path, listed.get(path.name))
        return checkpoint.as_checkpoint(state, str(path)), path
    except checkpoint.CheckpointError as exc:
        said = str(exc)  # the manifest's checks say what is wrong, torch's reader also where
        said = said if said.startswith(str(path)) else f"{resume}: {said}"
        raise checkpoint.CheckpointError(f"{flag} {said}") from None


def _why_no_checkpoint(path: Path, inside: Path) -> str:
    """Why a folder gave no checkpoint: a run folder whose checkpoints/ was deleted or holds
    none yet is told apart from a folder that is no run, whose fix differs."""
    if inside.is_dir():
        return (f"no checkpoint there: {inside} holds none (the run saved none yet, or they were "
                "deleted); give a checkpoint file, or another run folder")
    if is_run_folder(path):
        return (f"no checkpoint there: a run folder without its {inside.name}/ folder (deleted?); "
                "give a checkpoint file, or another run folder")
    return "no checkpoint there (expected a .pt file, or a run folder with checkpoints/)"


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False
