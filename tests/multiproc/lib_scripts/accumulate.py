"""Gradient accumulation under DDP: all-reduce only on the last micro-batch of each window.

Prints one JSON line on rank 0: how many all-reduce calls DDP made and how many optimizer steps ran,
plus the final weights, so the test can compare with a run without accumulation.
"""
import json
import sys

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

import multigpu

accumulate, batch_size = int(sys.argv[1]), int(sys.argv[2])
rt = multigpu.setup("ddp", accelerator="cpu", seed=0, accumulate=accumulate)
g = torch.Generator().manual_seed(1)
ds = TensorDataset(torch.randn(44, 6, generator=g), torch.randn(44, 1, generator=g))
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
model, loader = rt.prepare(model, DataLoader(ds, batch_size=batch_size, shuffle=True))
opt = torch.optim.SGD(model.parameters(), lr=0.1)

calls = 0


def counting_allreduce(state, bucket):
    global calls
    calls += 1
    return default_hooks.allreduce_hook(state, bucket)


model.register_comm_hook(None, counting_allreduce)
steps = 0
for _ in range(2):
    for x, y in loader:
        rt.backward(nn.functional.mse_loss(model(x), y))
        steps += rt.step(opt)
weights = [p.detach().flatten().tolist() for p in model.parameters()]
if rt.is_main:
    print(json.dumps({"allreduce_calls": calls, "optimizer_steps": steps, "weights": weights}))
