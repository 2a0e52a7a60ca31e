"""The one strategy interface: how a model is placed, wrapped and synchronised.

A strategy answers a handful of questions and nothing else:
- where the model lives and what wraps it (`setup_module`, `unwrap`);
- how the data is laid out per process (`devices_per_process`: DataParallel splits each
  process's batch over several GPUs, the others use one device per process);
- whether the next backward all-reduces gradients (`set_grad_sync`, for gradient accumulation);
- what goes into a checkpoint (`model_state_dict`), always without wrapper prefixes.

Collectives belong to `DistEnv`; mixed precision belongs to `Precision`.
Room for later: an FSDP strategy overrides `model_state_dict` / `optimizer_state_dict` to gather
shards, and `setup_module` to shard.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from multigpu.distributed import DistEnv


class Strategy(ABC):
    name: str = ""

    def __init__(self, env: DistEnv):
        self.env = env

    @property
    def device(self) -> torch.device:
        """Where inputs go: the process's device (DataParallel: its first GPU)."""
        return self.env.device

    @property
    def devices_per_process(self) -> int:
        return 1

    @abstractmethod
    def setup_module(self, model: nn.Module) -> nn.Module:
        """Move `model` to its device(s) and wrap it. The weights must already be loaded."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap_model(model)

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        """Whether the next forward/backward all-reduces gradients. Single process: nothing to do."""

    def model_state_dict(self, model: nn.Module) -> dict:
        return self.unwrap(model).state_dict()

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def describe(self) -> str:
        return self.name


def unwrap_model(model: nn.Module) -> nn.Module:
    """Peel DataParallel / DDP / torch.compile wrappers off `model`."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod  # torch.compile's OptimizedModule
        else:
            return model
