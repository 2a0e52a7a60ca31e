"""Portable, atomic checkpoints.

- One rank writes; the file appears whole or not at all (temp file in the same folder, fsync,
  rename), so a crash mid-save never leaves a truncated `last.pt`.
- Tensors are saved on the CPU and model keys carry no `module.` / `_orig_mod.` prefix, whatever
  the strategy (trap 12), so a checkpoint from any strategy loads into any other, and into a bare
  `nn.Module` with plain `torch.load(path, weights_only=True)`.
- Loading accepts prefixed state dicts too (checkpoints from hand-written DataParallel/DDP code).
- Only plain containers, numbers, strings and tensors go in, so `weights_only=True` can read it.
"""
from __future__ import annotations

import io
import os
import random
import re
import warnings
import zipfile
from pathlib import Path
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.core.system import fileio
from multigpu.core.checkpoints.checkpoint_schema import CheckpointError
from multigpu.core.loading.data import map_tensors
from multigpu.core.errors import UsageError
from multigpu.core.wrappers import clean_state_dict, match_keys, unwrap_model



def to_cpu(obj):
    """A copy of nested containers with every tensor moved to the CPU (portable files)."""
    return map_tensors(lambda t: t.detach().cpu(), obj)


def load_model_state(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True):
    """Load a state dict with or without wrapper prefixes into `model`, wrapped or not."""
    model = unwrap_model(model)
    return model.load_state_dict(match_keys(model.state_dict().keys(), state), strict=strict)


def atomic_save(obj, path: str | os.PathLike) -> Path:
    """torch.save `obj` to `path`; the file appears whole or not at all (fileio.atomic_write)."""
    return fileio.atomic_write(path, lambda f: torch.save(obj, f))


def check_loadable(extra: dict) -> None:
    """Refuse values that `torch.load(weights_only=True)` would refuse at resume time (numpy
    scalars, Path objects, ...): better to fail at the first save than after a crash."""
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        raise UsageError(f"a value passed to save() cannot be read back with weights_only=True "
                         f"({str(exc).splitlines()[0]}); convert it to int/float/str/list/dict "
                         "or a tensor") from None


def match_optimizer_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give each parameter's optimizer state the parameter's memory layout. A checkpoint from a
    run whose weights were laid out otherwise (channels_last on GPUs, not on CPUs) loads its
    state as it was saved, and CUDA's fused optimizers refuse "params, grads, exp_avgs, and
    exp_avg_sqs must have same dtype, device, and layout"."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if (isinstance(value, torch.Tensor) and value.shape == p.shape
                        and value.stride() != p.stride()):
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def numbered_optimizer_state(named: dict) -> dict:
    """torch.distributed.checkpoint's optimizer state (keyed by parameter name) in
    `optimizer.state_dict()`'s layout: parameters numbered 0, 1, ... across the groups in order."""
    number: dict[str, int] = {}
    groups = []
    for group in named["param_groups"]:
        ids = [number.setdefault(name, len(number)) for name in group["params"]]
        groups.append({**group, "params": ids})
    return {"state": {number[k]: v for k, v in named["state"].items()}, "param_groups": groups}


def named_optimizer_state(numbered: dict, order: list[str]) -> dict:
    """The inverse of `numbered_optimizer_state`, given the parameter names in optimizer order."""
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in numbered["param_groups"]]
    return {"state": {order[int(i)]: dict(v) for i, v in numbered["state"].items()},
            "param_groups": groups}  # new dicts throughout: torch puts shards into them


def load(path: str | os.PathLike) -> dict:
    """Read a checkpoint safely (weights_only: no pickled code is ever run) onto the CPU; any file
    that is not a readable checkpoint raises CheckpointError with one line saying why. torch's
    warnings (a legacy file's TypedStorage deprecation) stay off the console: the file is read or
    refused in our one line. A multigpu checkpoint of any format comes back in the current one
    (checkpoint_schema.read); anything else as torch.load returns it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # every way a file can fail to be a checkpoint: one line, no traceback
        raise CheckpointError(f"{path}: {_why_unreadable(path, exc)}") from None
    return schema.read(state, str(path)) if schema.is_checkpoint(state) else state


# torch.save's legacy format (_use_new_zipfile_serialization=False, torch < 1.6) begins with its
# magic number, pickled as a 10-byte long after the protocol opcode.
_LEGACY_MAGIC = b"\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"


def _is_legacy(path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2 + len(_LEGACY_MAGIC))[2:] == _LEGACY_MAGIC
    except OSError:
        return False


def _starts_as_zip(path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _why_unreadable(path, exc: Exception) -> str:
    text = str(exc)
    if isinstance(exc, OSError) and exc.filename is not None:  # opening it failed, not its bytes
        return f"cannot be read ({exc.strerror or text})"
    legacy = _is_legacy(path)
    if "Weights only load failed" in text and (legacy or zipfile.is_zipfile(path)):
        found = re.search(r"GLOBAL ([\w.]+)", text)
        what = found.group(1) if found else "objects other than tensors and plain values"
        return (f"refused: it holds {what}, which unpickling could run as code; multigpu reads "
                "checkpoints with weights_only=True and never runs code from one. If you made "
                "the file and trust it, load it yourself and save its state dicts with torch.save")
    size = os.path.getsize(path)
    if size == 0:
        return "the file is empty (a write that never finished?); use an earlier checkpoint"
    if legacy:
        first = (text.strip().splitlines() or [type(exc).__name__])[0]
        return (f"truncated or corrupt ({size} bytes): a file of torch.save's legacy format "
                f"that torch cannot read to its end ({first})")
    if not zipfile.is_zipfile(path):
        # torch 2.13 reads some cut archives to an OSError (EINVAL) rather than a zip message
        if "zip archive" in text or _starts_as_zip(path):
            return f"truncated or corrupt ({size} bytes): torch cannot find the end of its archive"
        return "not a checkpoint: torch.save writes a zip archive and this file is none"
    first = (text.strip().splitlines() or [type(exc).__name__])[0]
    return f"torch cannot read it ({first})"


# --- a model's bare state dict as --resume: its weights, nothing else ------------------------------

def as_checkpoint(state, where: str) -> dict:
    """A multigpu checkpoint, in the current format. A model's state dict
    (`torch.save(model.state_dict())`, prefixes of DataParallel/DDP and torch.compile peeled), or
    a dict holding one under a common key, as a checkpoint of weights alone: {MODEL: ...,
    FROM_STATE_DICT: where it was found}. Anything else: CheckpointError, saying what the file
    holds."""
    if schema.is_checkpoint(state):
        return schema.read(state, where)
    if _is_state_dict(state):
        return {schema.MODEL: clean_state_dict(state), schema.FROM_STATE_DICT: "a state dict"}
    if isinstance(state, dict):
        for key in schema.STATE_DICT_KEYS:
            if _is_state_dict(state.get(key)):
                return {schema.MODEL: clean_state_dict(state[key]),
                        schema.FROM_STATE_DICT: f"a state dict under its key {key!r}"}
    keys = list(state)[:5] if isinstance(state, dict) else []
    held = (f"a dict of {len(state)} entries ({', '.join(map(str, keys))}"
            f"{', ...' if len(state) > len(keys) else ''})" if isinstance(state, dict)
            else f"a {type(state).__name__}")
    raise CheckpointError(f"{where}: holds {held}, neither a multigpu checkpoint nor a model's "
                          "state dict; save model.state_dict() with torch.save, or give a run "
                          "folder of multigpu")


def _is_state_dict(obj) -> bool:
    """A mapping of parameter names to tensors (a module's `_extra_state` may be anything)."""
    return (isinstance(obj, Mapping) and bool(obj) and all(isinstance(k, str) for k in obj)
            and all(isinstance(v, torch.Tensor) for k, v in obj.items()
                    if not k.endswith("_extra_state")))


def weights_mismatch(model: nn.Module, state: Mapping[str, torch.Tensor], few: int = 3) -> str | None:
    """What keeps `state` from loading into `model` (wrapped or not): missing and unexpected
    keys and shapes that differ, a few of each; None when it fits."""
    expected = unwrap_model(model).state_dict()
    state = match_keys(expected.keys(), state)

    def some(names: list[str]) -> str:
        return ", ".join(names[:few]) + (f" and {len(names) - few} more" if len(names) > few else "")

    def dims(t) -> str:
        return "x".join(map(str, t.shape)) or "scalar"

    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} ({dims(state[k])} in the file, {dims(expected[k])} in the model)"
              for k in expected if k in state and isinstance(state[k], torch.Tensor)
              and tuple(state[k].shape) != tuple(expected[k].shape)]
    parts = ([f"missing {some(missing)}"] if missing else []) + (
        [f"unexpected {some(unexpected)}"] if unexpected else []) + (
        [f"other shapes: {some(shapes)}"] if shapes else [])
    return "; ".join(parts) or None


# --- RNG state: plain tensors and ints only, so weights_only loading accepts it -------------------

def rng_state() -> dict:
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
