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

import os
import random
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from torch import nn

FORMAT_VERSION = 1
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def clean_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip DataParallel/DDP (`module.`) and torch.compile (`_orig_mod.`) prefixes from every key."""
    out = {}
    for key, value in state.items():
        changed = True
        while changed:
            changed = False
            for prefix in _WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix):], True
        out[key] = value
    return out


def to_cpu(obj):
    """A copy of nested containers with every tensor moved to the CPU (portable files)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def load_model_state(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True):
    """Load a state dict with or without wrapper prefixes into `model`, wrapped or not."""
    from multigpu.strategies.base import unwrap_model  # strategies import us indirectly
    return unwrap_model(model).load_state_dict(clean_state_dict(state), strict=strict)


def atomic_save(obj, path: str | os.PathLike) -> Path:
    """torch.save to a temp file beside `path`, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: str | os.PathLike) -> dict:
    """Read a checkpoint safely (no pickled code is executed) onto the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)


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
