"""A one-process script that seeds nothing and makes its own data (as many toy examples do):
under --auto every rank must draw what rank 0 draws. Writes what it drew to ARGV[1]/rankN.json."""
import json
import os
import random
import sys

import numpy as np
import torch

x, y = torch.randn(16, 3), torch.randn(16, 1)
model = torch.nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
drawn = {"x": x.tolist(), "random": random.random(), "numpy": float(np.random.rand()),
         "weights": model.weight.tolist()}
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(drawn, f)
