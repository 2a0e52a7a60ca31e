"""A one-device script whose optimizer computes its gradients in a closure (LBFGS): the forward
and backward run inside optimizer.step(closure). Writes this process's weights to
weights_rank<RANK>.json."""
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
for x, y in DataLoader(data, batch_size=8, shuffle=True):
    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)  # noqa: B023 (step calls it now, as users write it)
        loss.backward()
        return loss
    optimizer.step(closure)
with open(f"weights_rank{os.environ.get('RANK', '0')}.json", "w") as f:
    json.dump({k: v.tolist() for k, v in model.state_dict().items()}, f)
