"""torch.save to a path (or a file opened on one) is written once, by rank 0, without wrapper
prefixes.

Every process runs the script's `torch.save(model.state_dict(), "model.pt")`; N processes writing
one file can leave it torn, and the weights are equal on every rank anyway. So rank 0 writes it
and the others wait (a barrier) until it exists, as the script expects when it reads it back.
State dicts lose `module.` (DataParallel, DDP) and `_orig_mod.` (torch.compile) prefixes, so the
file loads into the bare model, as a one-device run's does.

A whole model (`torch.save(model, PATH)`, the PyTorch tutorial's other way) is pickled as the
script's own class: the replicated module's class is replicate's `DDP<cls>`, which pickle cannot
find by name, and its state holds a process group and a Reducer; plain_pickle() writes the module
as a one-device run would, and torch.load gives back a model that runs anywhere.

What the script saved it may load back into the wrapper it saved from (pytorch/examples'
ImageNet --resume loads its DataParallel's checkpoint into its DataParallel): a wrapper's
load_state_dict given exactly its inner module's keys, without the prefix, loads them there.

The file appears whole or not at all (written beside it, then renamed): a save that fails midway
leaves the script's previous file. A file the script opened itself (`with open(path, "wb") as f:
torch.save(model, f)`, a tutorial's idiom) is a path too: pickled plainly, without prefixes, by
every rank into the file it opened, which is the user's on rank 0 and the rank's own copy on the
others (files.py). An in-memory buffer is written as the script writes it, replicated modules
pickled plainly. The barrier assumes what --auto keeps true: every process takes the same
decisions (same weights, the same whole evaluation data).
"""
from __future__ import annotations

import collections
import functools
import os
import pickle
import types
from collections.abc import Mapping

import torch
from torch import nn

from multigpu.core.system import fileio
from multigpu.auto.writes import files
from multigpu.auto.plain import plain_reduction, replicated_parts
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


class PlainPickler(pickle.Pickler):
    def reducer_override(self, obj):
        parts = replicated_parts(obj) if isinstance(obj, nn.Module) else None
        return NotImplemented if parts is None else plain_reduction(obj, parts)


def plain_pickle() -> types.ModuleType:
    """pickle, as torch.save's pickle_module, with replicated modules written plain."""
    module = types.ModuleType("pickle")
    module.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
    module.Pickler = PlainPickler
    return module


def write_whole(write, path) -> None:
    """`write(file)` to a temporary file put in place of `path`: a save that fails midway (an
    object pickle cannot write, a full disk) leaves the file that was there, where torch.save
    would have truncated it first. A folder that does not exist, or a path that is not a regular
    file (/dev/null), goes to `write(path)`, so torch says what it says without --auto."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or (os.path.exists(path) and not os.path.isfile(path)):
        return write(path)
    fileio.atomic_write(path, write)


def wrapper_inner(module: nn.Module, state) -> nn.Module | None:
    """The module a wrapper (DataParallel, DDP: a `.module` attribute) wraps, where `state` holds
    exactly that module's keys, as a file --auto saved holds them; else None."""
    inner = getattr(module, "module", None)
    if not isinstance(inner, nn.Module) or not isinstance(state, Mapping) or not state:
        return None
    return inner if set(state) == set(inner.state_dict()) else None


def install_loading() -> None:
    load = nn.Module.load_state_dict

    @functools.wraps(load)
    def load_state_dict(self, state_dict, *args, **kwargs):
        inner = wrapper_inner(self, state_dict)
        return load(self if inner is None else inner, state_dict, *args, **kwargs)

    nn.Module.load_state_dict = load_state_dict


def file_path(f):
    """The path of a file the script opened itself (`with open(path, "wb") as f`), its `name`;
    None for an in-memory buffer or a file of a bare descriptor."""
    name = getattr(f, "name", None)
    return name if isinstance(name, (str, os.PathLike)) else None


def install(env) -> None:
    install_loading()
    save = torch.save

    @functools.wraps(save)
    def save_once(obj, f, *args, **kwargs):
        if not args and "pickle_module" not in kwargs:  # the script's own pickle_module wins
            kwargs["pickle_module"] = plain_pickle()
        if not isinstance(f, (str, os.PathLike)):
            # each rank writes the file it opened: rank 0 the user's, the others their own
            # copies (files.py); a buffer is written as the script wrote it, plainly pickled
            return save(without_prefixes(obj) if file_path(f) else obj, f, *args, **kwargs)
        try:
            if env.rank == 0:
                write_whole(lambda out: save(without_prefixes(obj), out, *args, **kwargs), f)
        finally:
            env.barrier()  # the file exists on every rank once this returns
        files.forget(f)  # a copy of its own that a rank wrote there before is rank 0's file now

    torch.save = save_once
    torch.serialization.save = save_once
