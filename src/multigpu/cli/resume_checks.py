"""`multigpu train --resume`: a resume that cannot be used is refused here, in one line, before
the parent makes a run folder or starts a rank; one whose folder trained nothing starts afresh in it.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from multigpu.core import console
from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.core.errors import UsageError
from multigpu.train.settings.config import TrainConfig


def check_resume(cfg: TrainConfig) -> TrainConfig:
    """A --resume that cannot be used fails here, before a run folder is made (its checkpoint is
    read twice: here and on rank 0). Skipped when --out already has checkpoints of its own: the
    run goes on from those. The config the run goes on with: `cfg`, or, where nothing was trained
    in the folder --resume names, the config of a fresh start in it."""
    if not cfg.checkpointing.resume:  # (before the imports: they load torch and the checkpoint code)
        return cfg
    from multigpu.train.checkpoints.checkpoint_store import CheckpointStore
    from multigpu.train.rundir.runfolder import CONFIG
    from multigpu.train.checkpoints.runstate import load_source

    fresh = _fresh_start(cfg)
    if fresh is not None:
        return fresh
    if cfg.out and CheckpointStore(schema.checkpoints_folder(Path(cfg.out))).has_checkpoints():
        # the run goes on from --out's own checkpoints, whose model its config.json names
        path = Path(cfg.out)
        trained = _json_object(path / CONFIG)
    else:
        state, path = load_source(cfg.checkpointing.resume)
        trained = state.get(schema.CONFIG) or {}
        if state.get(schema.FROM_STATE_DICT):
            _refuse_misfit_weights(cfg, path, state)
            return cfg
    saved = trained.get("model")
    if saved and saved != cfg.model:  # its weights would not fit: refuse before any change
        raise UsageError(f"--resume {path}: its checkpoints are of --model {saved}, and this run "
                         f"asks for --model {cfg.model}; give --model {saved}, or another "
                         "checkpoint")
    _refuse_other_shapes(cfg, path, trained)
    return cfg


def _refuse_other_shapes(cfg: TrainConfig, path: Path, trained: dict) -> None:
    """A resume whose data gives the model other shapes than those it was trained on (the
    checkpoint's config: input_shape, num_outputs) would fail on every rank in a size-mismatch
    traceback: refused here, in one line naming the settings that differ."""
    shape, outputs = trained.get("input_shape"), trained.get("num_outputs")
    if shape is None or outputs is None:  # a checkpoint from before these facts were kept
        return
    from multigpu.train.training import image_size, load_run_data

    data = load_run_data(cfg)
    if (list(data.input_shape), data.num_outputs) == (list(shape), outputs):
        return
    def flag(key: str, value) -> str:
        name = "--" + key.replace("_", "-")
        return f"no {name}" if value is None else f"{name} {value}"
    given = {"data": cfg.input.data, "image_size": image_size(cfg)}
    differs = "; ".join(f"{flag(k, trained.get(k))} then, {flag(k, v)} now"
                        for k, v in given.items() if trained.get(k) != v)
    raise UsageError(f"--resume {path}: its model was trained on samples shaped {tuple(shape)} "
                     f"with {outputs} outputs, and this run's data gives "
                     f"{tuple(data.input_shape)} with {data.num_outputs}"
                     + (f" ({differs})" if differs else "")
                     + "; give the run's own --data and --image-size, or train a new run "
                     "without --resume")


def _refuse_misfit_weights(cfg: TrainConfig, path: Path, state: dict) -> None:
    """A bare state dict that does not fit the model: the ranks' one line, said before they
    start, from the model built on the meta device (no memory, no initialisation)."""
    import torch

    from multigpu.train.models.catalog import build_model
    from multigpu.train.checkpoints.resume import refuse_misfit
    from multigpu.train.training import load_run_data

    data = load_run_data(cfg)
    with torch.device("meta"):
        model = build_model(cfg.model, data.input_shape, data.num_outputs)
    refuse_misfit(path, state, model, cfg.model, data.name)


def _json_object(path: Path) -> dict:
    import json

    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _fresh_start(cfg: TrainConfig) -> TrainConfig | None:
    """--resume of a run folder in which nothing was trained (a launch killed or stopped during
    start-up): the run starts from scratch in it, said in one line; the config of that start, or
    None when something was trained there.
    A stop during start-up removes the folder it made, so --resume X --out X, the command a job
    script repeats, also starts from scratch where X does not exist."""
    from multigpu.train.rundir import runfolder

    source = Path(cfg.checkpointing.resume)
    same = not cfg.out or Path(cfg.out).resolve() == source.resolve()
    if source.is_dir() and runfolder.untrained_run_folder(source) and same:
        why = "no checkpoint"
    elif cfg.out and same and _only_logs(source):
        # --out R --resume R started on several nodes at once: another node's launcher made R's
        # logs/ before node 0 claimed R (runfolder.reserve's nodes_log)
        why = "only the logs of a launch"
    elif cfg.out and same and not source.exists() and not source.is_symlink():
        why = "no such folder: a run stopped while it started leaves none"
    else:
        return None
    console.info(f"multigpu train: --resume {cfg.checkpointing.resume}: nothing was trained "
                 f"there yet ({why}); starting from scratch in it")
    return replace(cfg, out=cfg.out or cfg.checkpointing.resume,
                   checkpointing=replace(cfg.checkpointing, resume=None))


def _only_logs(path: Path) -> bool:
    """A folder holding a launch's logs/ and nothing else (no config.json, no checkpoint)."""
    from multigpu.train.rundir import runfolder

    return ((path / runfolder.LOGS).is_dir() and not (path / runfolder.CONFIG).exists()
            and runfolder.nothing_trained(path, logs=True))
