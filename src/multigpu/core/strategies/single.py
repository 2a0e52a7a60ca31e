"""One device, one process: the baseline every other strategy must match."""
from __future__ import annotations

from torch import nn

from multigpu.core.distributed import DistEnv
from multigpu.core.errors import Api, Text, UsageError
from multigpu.core.strategies.base import Strategy


class SingleDevice(Strategy):
    name = "single"

    @classmethod
    def create(cls, env: DistEnv, *, device_ids: tuple[int, ...] = (),
               options: object | None = None) -> SingleDevice:
        if env.is_distributed:
            raise UsageError(Text(f"strategy 'single' was asked for, but {env.world_size} "
                                  "processes were launched; use {} (or auto), or launch one "
                                  "process", Api("setup.strategy", "ddp")))
        return cls(env)

    def setup_module(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def describe(self) -> str:
        return f"single ({self.device})"
