"""`setup()` and the `Runtime` it returns: the whole library API for a user's own training loop.

    import multigpu
    rt = multigpu.setup(precision="bf16")               # reads torchrun's environment
    model, optimizer, train_loader, val_loader = rt.prepare(model, optimizer, train_loader, val_loader)
    for epoch in range(epochs):
        for x, y in train_loader:                       # this rank's share, already on the device
            with rt.autocast():
                loss = loss_fn(model(x), y)
            rt.backward(loss)                           # exact global mean, loss scaling, no_sync
            rt.step(optimizer, clip_grad_norm=1.0)      # unscale, clip, step, zero_grad
    rt.save("checkpoints/last.pt", model=model, optimizer=optimizer, epoch=epoch)

The Runtime (multigpu.core.process_runtime, importable from here) holds explicit state only: the
DistEnv, the Strategy, the Precision, and the StepInfo of the batch the prepared loader yielded last.
"""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from multigpu.core import loggers as run_loggers
from multigpu.core.distributed import init_distributed
from multigpu.core.errors import UsageError
from multigpu.core.loading.global_batch import check_global_batch
from multigpu.core.precision import Precision, resolve_precision
# Runtime lives in its own module; `from multigpu.core.runtime import Runtime` is the path users
# and the train layer know, so it stays importable from here
from multigpu.core.process_runtime import Runtime
from multigpu.core.strategies import DDPOptions, Strategy, make_strategy

__all__ = ["Runtime", "make_precision", "seed_everything", "setup"]


def setup(strategy: str = "auto", precision: str = "fp32", *, devices: list[int] | None = None,
          accelerator: str = "auto", seed: int = 0, accumulate: int = 1,
          global_batch_size: int | None = None, ddp: DDPOptions | None = None, options: object | None = None,
          log_dir: str | Path | None = None, loggers: str = "tensorboard,csv",
          install_hooks: bool = False) -> Runtime:
    """Read the launcher's environment, create the process group, return a Runtime.

    Call it once, at the start of the script, on every process. Under `multigpu run` (or
    torchrun) each process takes the device of its LOCAL_RANK and joins the process group (NCCL on
    GPUs, gloo on CPUs); under plain `python script.py` it runs as one process, without a group.

    strategy:   "auto" (ddp when launched with several processes, else single), "single", "dp",
                "ddp", "fsdp" (parameters sharded over the processes: build the optimizer after
                prepare(), or pass prepare() a function that makes it from the parameters).
    precision:  "fp32", "bf16", "fp16" or "auto" (bf16 on GPUs that have it, else fp32).
    devices:    GPU ids for one process: `[2]` for single, `[0, 3]` for dp (default: all visible).
                Under a launcher each process takes GPU LOCAL_RANK; choose GPUs at launch time.
    seed:       orders the data (identically on every rank) and seeds Python, NumPy and torch
                with seed + rank, so dropout and augmentation differ between ranks; DDP copies
                rank 0's initial weights to the others.
    accumulate: micro-batches per optimizer step; the all-reduce runs only on the last one.
    global_batch_size: samples per optimizer step over all devices, the same on any device
                count: prepare() shares each step out and chooses the micro-batch (at most the
                DataLoader's batch_size, which is then the largest per device) and the
                accumulation (multigpu.core.loading.global_batch). Not with accumulate.
    ddp:        DDPOptions for the DDP engine (find_unused_parameters, static_graph, ...).
    options:    the strategy's options object: DDPOptions, or FSDPOptions for fsdp
                (shard_modules=(MyBlock,), min_params, reshard_after_forward, cpu_offload,
                activation_checkpointing); a tuple of several, each strategy taking its own.
    log_dir:    the folder `rt.log()` writes to (TensorBoard events, metrics.csv), on rank 0.
    loggers:    what `rt.log()` writes: any of "tensorboard", "csv", "mlflow", "wandb".
    install_hooks: True for a program that owns its process: the group is torn down at exit and
                sys.excepthook marks an uncaught exception as a failure (distributed.
                install_exit_hooks). Off by default: no process-wide state beyond the group and
                the device. `multigpu run` tears a script's group down itself; under plain
                torchrun, call multigpu.destroy_distributed() at the end.

    Returns the Runtime that prepares, steps and saves. Raises UsageError for a value it cannot
    use (an unknown precision, bf16 on a GPU without it, accumulate=0), naming the fix.

        rt = multigpu.setup(precision="bf16", accumulate=4)
        rt.print(rt)   # Runtime(rank=0, world_size=4, device=cuda:0, strategy=..., precision=bf16)
    """
    if accumulate < 1:
        raise UsageError(f"accumulate={accumulate} must be 1 or more")
    check_global_batch(global_batch_size, accumulate)
    log_names = run_loggers.parse(loggers)
    gpu_index = devices[0] if devices else None  # dp too: its first GPU, never GPU 0 by default
    env = init_distributed(accelerator, gpu_index=gpu_index, install_hooks=install_hooks)
    given = options if isinstance(options, (tuple, list)) else (options,)
    strat = make_strategy(strategy, env, device_ids=tuple(devices or ()),
                          options=tuple(o for o in (*given, ddp) if o is not None))
    seed_everything(seed + env.rank)
    rt = Runtime(env, strat, make_precision(precision, strat), seed=seed, accumulate=accumulate,
                 log_to=(Path(log_dir), log_names) if log_dir is not None else None)
    rt.global_batch = global_batch_size
    return rt


def make_precision(kind: str, strategy: Strategy) -> Precision:
    """The run's Precision on the strategy's device; the strategy is told the precision before
    it sets up a model."""
    kind = resolve_precision(kind, strategy.device)
    strategy.use_precision(kind)
    return Precision(kind, strategy.device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
