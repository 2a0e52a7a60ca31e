"""A one-device script that trains with a torch.optim optimizer on batches from a get_batch()
function slicing a tensor, with no DataLoader."""
import torch
from torch import nn

torch.manual_seed(0)
x = torch.randn(64, 4)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def get_batch(step, size=8):
    i = step * size % len(x)
    return x[i:i + size], y[i:i + size]


model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(16):
    xb, yb = get_batch(step)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(xb), yb)
    loss.backward()
    optimizer.step()
print(f"loss {loss.item():.4f}")
