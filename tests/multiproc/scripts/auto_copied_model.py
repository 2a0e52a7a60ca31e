"""A one-device script that trains a model it did not build through module attributes: a whole
model saved and loaded back (torch.save(model) / torch.load), then copied (copy.deepcopy, as a
student of a teacher), and an EMA copy of the student made after its optimizer (as timm's
ModelEma). Writes this process's trained weights to weights_rank<RANK>.json."""
import copy
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
torch.save(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), "whole.pt")
teacher = torch.load("whole.pt", weights_only=False)
student = copy.deepcopy(teacher)
optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
ema = copy.deepcopy(student)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
for x, y in DataLoader(data, batch_size=8, shuffle=True):
    optimizer.zero_grad()
    nn.functional.mse_loss(student(x), y).backward()
    optimizer.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), student.parameters()):
            e.mul_(0.5).add_(p, alpha=0.5)
with open(f"weights_rank{os.environ.get('RANK', '0')}.json", "w") as f:
    json.dump({"student": {k: v.tolist() for k, v in student.state_dict().items()},
               "ema": {k: v.tolist() for k, v in ema.state_dict().items()},
               "ema_class": type(ema).__name__}, f)
