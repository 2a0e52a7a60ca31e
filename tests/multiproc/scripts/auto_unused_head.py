"""A one-device script whose model has a head its loss never uses (as a pretrained model's
pooler): DDP needs --auto-unused for it. Writes this process's weights to weights_rank<RANK>.json."""
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head, self.spare_head = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


torch.manual_seed(0)
model = TwoHeads()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
for x, y in DataLoader(data, batch_size=8, shuffle=True):
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
with open(f"weights_rank{os.environ.get('RANK', '0')}.json", "w") as f:
    json.dump({k: v.tolist() for k, v in model.state_dict().items()}, f)
