"""A one-device script without a seed of its own: its model starts from other weights in each
process. An EMA copy of it is made after its optimizer (as timm's ModelEma), then the EMA's
validation loss decides which checkpoint is the best. Writes this process's weights to
weights_rank<RANK>.json."""
import copy
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
ema = copy.deepcopy(model).requires_grad_(False)
g = torch.Generator().manual_seed(1)  # the data, as a file would give it: the same in every run
data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
for x, y in DataLoader(data, batch_size=8, shuffle=True):
    x, y = x.to(device), y.to(device)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.9).add_(p, alpha=0.1)
with open(f"weights_rank{os.environ.get('RANK', '0')}.json", "w") as f:
    json.dump({"model": {k: v.tolist() for k, v in model.state_dict().items()},
               "ema": {k: v.tolist() for k, v in ema.state_dict().items()}}, f)
