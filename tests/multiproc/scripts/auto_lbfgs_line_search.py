"""A one-device script whose LBFGS searches its step size (line_search_fn="strong_wolfe", as
physics-informed and style-transfer tutorials do): each decision inside optimizer.step(closure)
reads the loss the closure returns. Writes this process's weights, and the losses step()
returned, to weights_rank<RANK>.json."""
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
optimizer = torch.optim.LBFGS(model.parameters(), max_iter=12, line_search_fn="strong_wolfe")
g = torch.Generator().manual_seed(1)
x_all = torch.randn(64, 4, generator=g)
data = TensorDataset(x_all, torch.sin(x_all.sum(1, keepdim=True)))
losses = []
for _ in range(3):
    for x, y in DataLoader(data, batch_size=64, shuffle=True):  # the whole set: one step an epoch
        x, y = x.to(device), y.to(device)
        def closure():
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)  # noqa: B023 (step calls it now, as users write it)
            loss.backward()
            return loss
        losses.append(optimizer.step(closure).item())
with open(f"weights_rank{os.environ.get('RANK', '0')}.json", "w") as f:
    json.dump({"losses": losses} | {k: v.tolist() for k, v in model.state_dict().items()}, f)
