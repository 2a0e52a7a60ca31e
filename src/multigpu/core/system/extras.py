"""Optional dependencies: the parts of multigpu that need more than the core install.

The core (train, run, gpus, env, the library) needs torch, numpy, rich, nvidia-ml-py, psutil,
pyyaml and tensorboard. The rest comes with an extra of pyproject.toml, and a missing one is
reported in one line that names it, instead of an ImportError from deep inside.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from multigpu.core.errors import UsageError

# module -> (pip distribution, the multigpu extra that brings it)
EXTRAS = {
    "matplotlib": ("matplotlib", "plot"),
    "accelerate": ("accelerate", "bench"),
    "lightning": ("lightning", "bench"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
    "submitit": ("submitit", "slurm"),
}


class MissingExtra(UsageError):
    """An optional dependency is not installed; the message says which extra brings it."""


def install_hint(module: str, extra: str | None = None) -> str:
    """`pip install 'multigpu[EXTRA]'` (or the package alone) for an optional module; `extra`
    names a larger extra that also brings it (bench for its plot, say)."""
    dist, smallest = EXTRAS[module]
    return f"pip install 'multigpu[{extra or smallest}]' (or pip install {dist})"


def require(module: str, purpose: str, extra: str | None = None) -> ModuleType:
    """Import an optional `module`, or raise MissingExtra: "`purpose` needs X: pip install ..."."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{purpose} needs {module}, which is not installed: "
                           f"{install_hint(module, extra)}") from None
