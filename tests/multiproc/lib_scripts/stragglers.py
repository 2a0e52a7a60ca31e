"""A tiny library run whose one rank is slowed where the environment says: SLOW_DATA_RANK
sleeps SLOW_MS in each of that rank's sample reads (its loader), SLOW_COMPUTE_RANK in each of
that rank's forwards (its compute). Prints one JSON line on rank 0: the per-rank figures of each
epoch (Runtime.stragglers.take()) and the sentences said."""
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import multigpu

EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
rt = multigpu.setup("ddp", accelerator="cpu", seed=0)
pause = float(os.environ.get("SLOW_MS", "20")) / 1e3


def slowed(kind: str) -> bool:
    return os.environ.get(f"SLOW_{kind}_RANK") == str(rt.rank)


class Samples(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(96, 6, generator=g), torch.randn(96, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if slowed("DATA"):
            time.sleep(pause / 4)  # 4 samples a batch
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        if slowed("COMPUTE") and torch.is_grad_enabled():
            time.sleep(pause)
        return self.body(x)


model, loader = rt.prepare(Net(), DataLoader(Samples(), batch_size=4, shuffle=True))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
epochs = []
for _ in range(EPOCHS):
    for x, y in loader:
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(opt)
    ranks, said = rt.stragglers.take()
    epochs.append({"ranks": ranks, "said": said})
if rt.is_main:
    print(json.dumps(epochs))
