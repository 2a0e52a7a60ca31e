"""The block of the large-model GPU scripts (fsdp_big.py, fsdp_offload_big.py): two square
linear layers with a residual, 2 x width^2 parameters."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))
