"""The Runtime's checkpoints: `rt.save`, `rt.checkpoint_state` and `rt.load` (their docstrings
are the API), as functions of the Runtime they work for."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from multigpu.core.checkpoints import checkpoint, sharded_checkpoint
from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.core.errors import UsageError


def save(rt, path: str | Path, *, model: nn.Module, optimizer=None, scheduler=None,
         sharded: bool = False, **extra) -> None:
    """Runtime.save."""
    path = Path(path)
    shards = {}
    if sharded:
        shards[schema.SHARDS] = sharded_checkpoint.save(rt.env, path.parent, path.stem, model,
                                                   optimizer)
    error = None
    try:  # collective first; then only rank 0 can fail (a value weights_only refuses)
        state = checkpoint_state(rt, model, optimizer, scheduler, weights=not sharded, **shards,
                                 **extra)
    except UsageError as exc:
        error = (True, str(exc))
    if rt.env.is_main and error is None:
        try:
            replaced = sharded_checkpoint.folder_named_by(path)
            checkpoint.atomic_save(checkpoint.to_cpu(state), path)
            sharded_checkpoint.drop_if_unnamed(replaced)  # the replaced file's folder
        except Exception as exc:  # tell the other ranks instead of leaving them in a barrier
            error = (isinstance(exc, UsageError), f"saving {path} failed on rank 0: {exc}")
    error = rt.env.broadcast_object(error)
    if error:
        raise (UsageError if error[0] else RuntimeError)(error[1])


def checkpoint_state(rt, model: nn.Module, optimizer=None, scheduler=None, *,
                     weights: bool = True, **extra) -> dict | None:
    """Runtime.checkpoint_state."""
    rng = rt.env.all_gather_object(checkpoint.rng_state())
    model_state = rt.strategy.model_state_dict(model) if weights else None  # collective
    optimizer_state = (rt.strategy.optimizer_state_dict(model, optimizer)
                       if weights and optimizer else None)
    if not rt.env.is_main:
        return None
    checkpoint.check_loadable(extra)
    return {
        schema.FORMAT: schema.FORMAT_VERSION,
        schema.MODEL: model_state,
        schema.OPTIMIZER: optimizer_state,
        schema.SCHEDULER: scheduler.state_dict() if scheduler is not None else None,
        schema.PRECISION: rt.precision.state_dict(),
        schema.RNG: rng,
        schema.WORLD_SIZE: rt.env.world_size,
        schema.STRATEGY: rt.strategy.name,
        **extra,
    }


def load(rt, path: str | Path | dict, *, model: nn.Module | None = None, optimizer=None,
         scheduler=None, shards_dir: str | Path | None = None) -> dict:
    """Runtime.load."""
    state = _read(path) if isinstance(path, dict) else checkpoint.load(path)
    # torch.distributed.checkpoint's loaders step the optimizer once, with no gradients, to
    # create its state: not a user's optimizer.step() around the runtime
    with rt._bypass.stepping():
        if state.get(schema.SHARDS):  # written sharded (multigpu train under fsdp)
            _load_shards(rt, state, path, shards_dir, model, optimizer)
        else:
            if model is not None:
                rt.strategy.load_model_state(model, state[schema.MODEL])
            if optimizer is not None and state.get(schema.OPTIMIZER):
                rt.strategy.load_optimizer_state(model, optimizer, state[schema.OPTIMIZER])
    if optimizer is not None:
        checkpoint.match_optimizer_layout(optimizer)
    if scheduler is not None and state.get(schema.SCHEDULER):
        scheduler.load_state_dict(state[schema.SCHEDULER])
    if state.get(schema.PRECISION):
        rt.precision.load_state_dict(state[schema.PRECISION])
    rng = state.get(schema.RNG) or []
    if len(rng) == rt.env.world_size:  # same layout: every rank resumes its own streams
        checkpoint.set_rng_state(rng[rt.env.rank])
    return state


def _read(state: dict) -> dict:
    """A checkpoint dict given to load(): read as a file's would be (any format), or as it is."""
    if not schema.is_checkpoint(state):
        return state
    return schema.read(state, "the checkpoint dict given to load()")


def _load_shards(rt, state: dict, path, shards_dir, model, optimizer) -> None:
    if model is None:
        raise UsageError("this checkpoint was saved sharded; load(model=...) reads it into "
                         "the prepared model (and optimizer)")
    if shards_dir is None:
        if isinstance(path, dict):
            raise UsageError("this checkpoint was saved sharded: give load() its file, or "
                             "shards_dir= the folder its shards are in")
        shards_dir = sharded_checkpoint.folder_of(state, Path(path).parent)
    sharded_checkpoint.load(rt.env, Path(shards_dir), state[schema.SHARDS][schema.SHARDS_FILES],
                            None if isinstance(path, dict) else path,
                            rt.strategy.unwrap(model), optimizer)
