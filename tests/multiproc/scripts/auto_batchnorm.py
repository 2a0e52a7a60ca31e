"""A one-device script whose model leans on BatchNorm: a small conv net with BatchNorm2d, a
BatchNorm1d, and a BatchNorm1d without affine weights (known by its running mean alone), trained
with SGD on a batch of 8 (`--compile`: through torch.compile), then evaluated in eval mode (the
running statistics).

For the tests it writes seen_rank<RANK>.json: each step's sample indices, the final state dict
(running statistics included) and the eval outputs.
"""
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Images(Dataset):
    def __init__(self, n=48):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, 6, 6, generator=g) * 2 + 1
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def make_model():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(),
        nn.Linear(8, 5), nn.BatchNorm1d(5, affine=False), nn.Linear(5, 3))


def main():
    torch.manual_seed(0)
    data = Images()
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model = make_model()
    run = torch.compile(model) if "--compile" in sys.argv else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for epoch in range(2):
        for x, y, idx in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(run(x), y)
            loss.backward()
            optimizer.step()
            steps.append(idx.tolist())
        print(f"epoch {epoch}: loss {loss.item():.4f}")
    model.eval()
    with torch.no_grad():
        out = model(data.x[:4])
    record = {"steps": steps, "weights": {k: v.tolist() for k, v in model.state_dict().items()},
              "eval": out.tolist()}
    with open(f"seen_rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
