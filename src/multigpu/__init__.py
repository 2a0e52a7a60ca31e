"""multigpu: PyTorch training from one GPU to every GPU of a machine, without the classic traps.

The library API is `setup()` and the `Runtime` it returns; see `multigpu.runtime` for a full loop.
"""
from multigpu.checkpoint import clean_state_dict, load_model_state
from multigpu.compiling import begin_step, compile_model
from multigpu.data import ShardedBatchSampler, StepInfo
from multigpu.distributed import DistEnv, destroy_distributed, init_distributed
from multigpu.errors import UsageError
from multigpu.metrics import Accuracy, MeanMetric, Sums, reduce_tensor
from multigpu.precision import Precision
from multigpu.runtime import Runtime, setup
from multigpu.strategies import DDPOptions, unwrap_model

__version__ = "0.1.0"

__all__ = [
    "setup", "Runtime", "DistEnv", "init_distributed", "destroy_distributed", "Precision",
    "DDPOptions", "ShardedBatchSampler", "StepInfo", "Sums", "MeanMetric", "Accuracy",
    "reduce_tensor", "clean_state_dict", "load_model_state", "unwrap_model", "UsageError",
    "compile_model", "begin_step",
]
