"""The one strategy interface: how a model is placed, wrapped, synchronised and saved.

A strategy answers a handful of questions and nothing else:
- how it is made for a process (`create`: the launch it finds, its options object);
- where the model lives and what wraps it (`setup_module`, `unwrap`); the optimizer is built
  on the parameters of the wrapped model (a sharding strategy replaces them);
- how the data is laid out per process (`devices_per_process`: DataParallel splits each
  process's batch over several GPUs, the others use one device per process);
- whether the next backward reduces gradients (`set_grad_sync`, for gradient accumulation),
  and whether a parameter without a gradient breaks the next step (`check_unused`);
- what goes into a checkpoint and back (`model_state_dict`, `optimizer_state_dict`,
  `load_model_state`, `load_optimizer_state`): always the whole model, without wrapper prefixes,
  the optimizer's state numbered as torch numbers it, so a checkpoint of one strategy loads into
  any other. Saving is collective: every rank calls them, rank 0's answer is written.

What a strategy is called and what it allows before anything is built: registry.py.
Collectives belong to `DistEnv`; mixed precision belongs to `Precision`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from multigpu.core.distributed import DistEnv
from multigpu.core.wrappers import unwrap_model as unwrap_model  # its home until now: still importable here


class Strategy(ABC):
    name: str = ""
    options_type: type | None = None  # its options dataclass (DDPOptions, ...), if it has one

    def __init__(self, env: DistEnv):
        self.env = env

    @classmethod
    def create(cls, env: DistEnv, *, device_ids: tuple[int, ...] = (),
               options: object | None = None) -> Strategy:
        """The strategy for this process: `device_ids` are the GPUs one process drives (dp),
        `options` the strategy's own options object (others' are ignored)."""
        return cls(env)

    @classmethod
    def own_options(cls, options: object | None):
        """Of `options` (one options object, or several of different strategies), the one of
        this strategy's kind, else None (its defaults)."""
        given = options if isinstance(options, (tuple, list)) else (options,)
        return next((o for o in given if cls.options_type and isinstance(o, cls.options_type)), None)

    def use_precision(self, kind: str) -> None:  # noqa: B027 (a hook, empty on purpose)
        """Told the run's precision ("fp32", "bf16", "fp16") before the model is set up."""


    @property
    def device(self) -> torch.device:
        """Where inputs go: the process's device (DataParallel: its first GPU)."""
        return self.env.device

    @property
    def devices(self) -> list[torch.device]:
        """Every device this process computes on (DataParallel: each of its GPUs)."""
        return [self.device]

    @property
    def devices_per_process(self) -> int:
        return len(self.devices)

    @abstractmethod
    def setup_module(self, model: nn.Module) -> nn.Module:
        """Move `model` to its device(s) and wrap it. The weights must already be loaded."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap_model(model)

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:  # noqa: B027 (a hook, empty on purpose)
        """Whether the next forward/backward all-reduces gradients. Single process: nothing to do."""

    @property
    def sharded_state(self) -> bool:
        """Whether each rank holds only part of the model: its run checkpoints are then saved
        sharded, every rank writing its own part (sharded_checkpoint.py)."""
        return False

    def check_unused(self, models: list[nn.Module]) -> None:  # noqa: B027 (a hook, empty on purpose)
        """After the first backward: refuse parameters without a gradient where that would fail
        later (DDP), naming them. Nothing to check in one process."""

    def model_state_dict(self, model: nn.Module) -> dict:
        """Collective. The whole model's state, bare keys; tensors may stay on the device."""
        return self.unwrap(model).state_dict()

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Collective. The optimizer's whole state as `optimizer.state_dict()` lays it out."""
        return optimizer.state_dict()

    def load_model_state(self, model: nn.Module, state: dict) -> None:
        """Every rank, the whole state of `model_state_dict` (prefixed keys accepted)."""
        from multigpu.core.checkpoints.checkpoint import load_model_state
        load_model_state(model, state)

    def load_optimizer_state(self, model: nn.Module | None, optimizer: torch.optim.Optimizer,
                             state: dict) -> None:
        """Every rank, the whole state of `optimizer_state_dict`; `model` may be None where the
        strategy does not need it to place the state."""
        optimizer.load_state_dict(state)

    def describe(self) -> str:
        return self.name
