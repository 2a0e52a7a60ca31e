"""The wrappers torch puts around a model (DataParallel, DistributedDataParallel, torch.compile's
OptimizedModule) and the key prefixes they give its state dict (`module.`, `_orig_mod.`).

One leaf module for both: strategies peel the wrappers off, checkpoints peel the prefixes off,
and neither has to import the other for it.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DataParallel / DDP / torch.compile wrappers off `model`."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod  # torch.compile's OptimizedModule
        else:
            return model


def _strip_one_prefix(state: Mapping[str, torch.Tensor]) -> dict | None:
    """`state` without a wrapper prefix that every key carries, or None when there is none."""
    prefix = next((p for p in _WRAPPER_PREFIXES if state and all(k.startswith(p) for k in state)), None)
    return None if prefix is None else {k[len(prefix):]: v for k, v in state.items()}


def clean_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip DataParallel/DDP (`module.`) and torch.compile (`_orig_mod.`) prefixes, as long as
    every key carries one."""
    out = dict(state)
    while (stripped := _strip_one_prefix(out)) is not None:
        out = stripped
    return out


def match_keys(expected, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """`state` with wrapper prefixes peeled, one at a time, until its keys are `expected`: a
    model with a real child named `module` (an EMA wrapper, say) keeps that part of its keys."""
    expected = set(expected)
    while set(state) != expected and (stripped := _strip_one_prefix(state)) is not None:
        state = stripped
    return state
