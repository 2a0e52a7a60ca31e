"""One device, one process: the baseline every other strategy must match."""
from __future__ import annotations

from torch import nn

from multigpu.strategies.base import Strategy


class SingleDevice(Strategy):
    name = "single"

    def setup_module(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def describe(self) -> str:
        return f"single ({self.device})"
