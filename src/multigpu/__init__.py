"""multigpu: PyTorch training from one GPU to every GPU of a machine, without the classic traps.

The library API is `setup()` and the `Runtime` it returns; see `multigpu.core.runtime` for a full loop.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module of the library (multigpu.core) that defines it. They are imported on
# first use (PEP 562), so that `multigpu --help` and the CLI's usage errors answer without
# importing torch (about 1.5 s).
_EXPORTS = {
    "clean_state_dict": "checkpoints.checkpoint", "load_model_state": "checkpoints.checkpoint",
    "begin_step": "compiling", "compile_model": "compiling",
    "ShardedBatchSampler": "loading.data", "StepInfo": "loading.data",
    "DistEnv": "distributed", "destroy_distributed": "distributed", "init_distributed": "distributed",
    "UsageError": "errors",
    "Accuracy": "metrics", "MeanMetric": "metrics", "Sums": "metrics", "reduce_tensor": "metrics",
    "Precision": "precision",
    "Runtime": "runtime", "setup": "runtime",
    "DDPOptions": "strategies", "FSDPOptions": "strategies", "unwrap_model": "strategies",
    "load_model": "multigpu.train.models.trained_model",  # a model `multigpu train` trained
    "ShardedImages": "multigpu.train.data.shards",  # WebDataset tar shards as a dataset
}

__all__ = [
    "setup", "Runtime", "DistEnv", "init_distributed", "destroy_distributed", "Precision",
    "DDPOptions", "FSDPOptions", "ShardedBatchSampler", "StepInfo", "Sums", "MeanMetric", "Accuracy",
    "reduce_tensor", "clean_state_dict", "load_model_state", "unwrap_model", "UsageError",
    "compile_model", "begin_step", "load_model", "ShardedImages",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'multigpu' has no attribute {name!r}")
    path = module if module.startswith("multigpu.") else f"multigpu.core.{module}"
    value = getattr(importlib.import_module(path), name)
    globals()[name] = value  # the next lookup skips this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # for type checkers and IDEs, which do not run __getattr__
    from multigpu.core.checkpoints.checkpoint import clean_state_dict, load_model_state
    from multigpu.core.compiling import begin_step, compile_model
    from multigpu.core.loading.data import ShardedBatchSampler, StepInfo
    from multigpu.core.distributed import DistEnv, destroy_distributed, init_distributed
    from multigpu.core.errors import UsageError
    from multigpu.core.metrics import Accuracy, MeanMetric, Sums, reduce_tensor
    from multigpu.core.precision import Precision
    from multigpu.core.runtime import Runtime, setup
    from multigpu.core.strategies import DDPOptions, FSDPOptions, unwrap_model
    # load_model (multigpu.train.models.trained_model) is left out: a static import of the train layer
    # here would make every module that imports multigpu import it, as the layers forbid
