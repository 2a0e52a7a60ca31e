"""A model that `multigpu train` trained, back as the nn.Module it was: `multigpu.load_model`.

Every checkpoint keeps the run's resolved settings (training.resolved_config), among them the
model's name and the shape of its input and output; from those the model is built as the run
built it (models.build_model) and the checkpoint's weights go in. A run of `--strategy fsdp`
keeps its weights in shards: `multigpu export` makes them one file first.
"""
from __future__ import annotations

import os

from torch import nn

from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.core.checkpoints.checkpoint import load_model_state
from multigpu.core.errors import UsageError


def load_model(source: str | os.PathLike) -> nn.Module:
    """The model of a `multigpu train` run, with its trained weights, on the CPU, in eval mode.

    `source`: a run folder (its newest readable checkpoint), or one of its checkpoint files
    (`RUN/checkpoints/best.pt`). For example::

        model = multigpu.load_model("runs/digits/checkpoints/best.pt")
        logits = model(images)
    """
    from multigpu.train.models.catalog import build_model
    from multigpu.train.checkpoints.runstate import load_source

    state, path = load_source(str(source), flag="load_model")
    config = state.get(schema.CONFIG) or {}
    if state.get(schema.FROM_STATE_DICT) or "input_shape" not in config:
        raise UsageError(f"{path} does not say how its model was built (a multigpu train checkpoint "
                         "of an older multigpu, or another script's weights): build the model "
                         "yourself and load torch.load(path, weights_only=True)['model'] into it")
    if state.get(schema.SHARDS):
        raise UsageError(f"{path} keeps its weights in shards (--strategy fsdp): make them one "
                         f"file with `multigpu export {source}`, then load_model that file")
    model = build_model(config["model"], tuple(config["input_shape"]), int(config["num_outputs"]))
    load_model_state(model, state[schema.MODEL])
    return model.eval()
