"""torch.save to a path is written once, by rank 0, without wrapper prefixes.

Every process runs the script's `torch.save(model.state_dict(), "model.pt")`; N processes writing
one file can leave it torn, and the weights are equal on every rank anyway. So rank 0 writes it
and the others wait (a barrier) until it exists, as the script expects when it reads it back.
State dicts lose `module.` (DataParallel, DDP) and `_orig_mod.` (torch.compile) prefixes, so the
file loads into the bare model, as a one-device run's does.

Only paths (str, os.PathLike) are handled: a file object or an in-memory buffer the script opened
itself is written by every process, as before. The barrier assumes what --auto keeps true: every
process takes the same decisions (same weights, the same whole evaluation data).
"""
from __future__ import annotations

import collections
import functools
import os
from typing import Mapping

import torch

from multigpu.core.wrappers import clean_state_dict


def is_state_dict(obj) -> bool:
    return (isinstance(obj, Mapping) and len(obj) > 0
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()))


def strip_prefixes(state: Mapping):
    """`state` without the wrapper prefixes every key carries (an OrderedDict keeping torch's
    `_metadata`, renamed alike), or `state` itself when there are none."""
    clean = clean_state_dict(state)
    if list(clean) == list(state):
        return state
    first = next(iter(state))
    prefix = first[:len(first) - len(next(iter(clean)))]
    out = collections.OrderedDict(clean)
    meta = getattr(state, "_metadata", None)
    if meta is not None:
        out._metadata = collections.OrderedDict(
            ("" if k + "." == prefix else k[len(prefix):], v) for k, v in meta.items()
            if k + "." == prefix or k.startswith(prefix))
    return out


def without_prefixes(obj):
    """`obj` with prefixes stripped from a state dict, or from the state dicts a checkpoint
    dict holds one level down ({"model": model.state_dict(), "epoch": 3, ...})."""
    if is_state_dict(obj):
        return strip_prefixes(obj)
    if isinstance(obj, dict):
        out = {k: strip_prefixes(v) if is_state_dict(v) else v for k, v in obj.items()}
        return out if any(out[k] is not obj[k] for k in obj) else obj
    return obj


def install(env) -> None:
    save = torch.save

    @functools.wraps(save)
    def save_once(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return save(obj, f, *args, **kwargs)
        try:
            if env.rank == 0:
                save(without_prefixes(obj), f, *args, **kwargs)
        finally:
            env.barrier()  # the file exists on every rank once this returns

    torch.save = save_once
    torch.serialization.save = save_once
