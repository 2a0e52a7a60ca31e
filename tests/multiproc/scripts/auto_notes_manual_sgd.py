"""A one-device script with no torch.optim optimizer, as hand-written tutorials train: batches
sliced from a tensor in a loop (or, with `split`, a shuffled DataLoader), gradients from
loss.backward() (or, with `grad`, torch.autograd.grad), and an update by hand (p.data.add_).
No seed: under --auto each process trains a model of its own."""
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

x = torch.randn(32, 4)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
model = nn.Linear(4, 1)
if "split" in sys.argv:
    batches = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
else:
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, len(x), 8)]
for _ in range(2):
    for xb, yb in batches:
        loss = nn.functional.mse_loss(model(xb), yb)
        if "grad" in sys.argv:
            grads = torch.autograd.grad(loss, list(model.parameters()))
        else:
            model.zero_grad()
            loss.backward()
            grads = [p.grad for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.data.add_(-0.1 * g)
print(f"loss {loss.item():.4f}")
