"""setup(global_batch_size=G) in a user's loop: the same optimizer steps on any process count.

argv: G, the DataLoader's batch_size (the largest per device). Prints one JSON line on rank 0:
the plan prepare() chose, the optimizer steps and the final weights.
"""
import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multigpu

global_batch, batch_size = int(sys.argv[1]), int(sys.argv[2])
rt = multigpu.setup("ddp", accelerator="cpu", seed=0, global_batch_size=global_batch)
g = torch.Generator().manual_seed(1)
ds = TensorDataset(torch.randn(70, 6, generator=g), torch.randn(70, 1, generator=g))
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
model, loader = rt.prepare(model, DataLoader(ds, batch_size=batch_size, shuffle=True))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = 0
for _ in range(2):
    for x, y in loader:
        rt.backward(nn.functional.mse_loss(model(x), y))
        steps += rt.step(opt)
weights = [p.detach().flatten().tolist() for p in model.parameters()]
if rt.is_main:
    plan = rt.batch_plan
    print(json.dumps({"plan": [plan.micro, plan.accumulate], "optimizer_steps": steps,
                      "weights": weights}))
