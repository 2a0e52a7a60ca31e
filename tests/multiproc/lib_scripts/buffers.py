"""Buffers under DDPOptions(broadcast_buffers=False) on 2 processes: equal after prepare, apart
after training on different data, rank 0's everywhere after rt.sync_buffers().

Prints one JSON line on rank 0 with, at each of the three points, whether every rank holds rank
0's buffers.
"""
import json

import torch
from torch import nn

import multigpu
from multigpu.core.strategies import DDPOptions


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("noise", torch.randn(3))  # differs per rank: seeded with seed + rank
        self.register_buffer("grid", torch.randn(4, 3).t())  # not contiguous, differs per rank

    def forward(self, x):
        return self.bn(self.fc(x)) + self.noise.sum() + self.grid.sum()


rt = multigpu.setup("ddp", accelerator="cpu", seed=0, ddp=DDPOptions(broadcast_buffers=False))
model = rt.prepare(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def same_as_rank0() -> bool:
    flat = torch.cat([b.float().flatten() for b in rt.strategy.unwrap(model).buffers()])
    mine, first = flat.clone(), flat.clone()
    rt.env.broadcast_tensors([first])
    equal = torch.tensor([float(torch.equal(mine, first))])
    return bool(rt.env.all_reduce(equal, op="min").item())


after_prepare = same_as_rank0()
g = torch.Generator().manual_seed(10 + rt.rank)  # each rank its own data
for _ in range(3):
    x = torch.randn(8, 4, generator=g) * (1 + rt.rank)
    rt.backward(model(x).pow(2).mean())
    rt.step(opt)
after_training = same_as_rank0()
rt.sync_buffers(model)
after_sync = same_as_rank0()
if rt.is_main:
    print(json.dumps({"after_prepare": after_prepare, "after_training": after_training,
                      "after_sync": after_sync}))
