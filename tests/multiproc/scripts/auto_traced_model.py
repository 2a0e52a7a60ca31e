"""A one-device script whose model's first forward runs under a tracer, before training: as
tensorboard's `SummaryWriter().add_graph(model, x)` does, after the optimizer is made (the
PyTorch tutorial's order). `--how jit` (torch.jit.trace), `tensorboard` (add_graph into ./runs),
`export` (torch.export.export). Then a few steps on a shuffled DataLoader. Writes this
process's trained weights, the traced module's outputs and class name to traced_rank<RANK>.json.
"""
import argparse
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def by_hand(model, x):
    """The model's output from its weights now, without calling it (its first call is traced)."""
    with torch.no_grad():
        h = torch.tanh(nn.functional.linear(x, model.hidden.weight, model.hidden.bias))
        return nn.functional.linear(h, model.out.weight, model.out.bias)


how = argparse.ArgumentParser()
how.add_argument("--how", choices=("jit", "tensorboard", "export"), default="jit")
how = how.parse_args().how
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
seen = {"expected": by_hand(model, x0).tolist()}
if how == "jit":
    traced = torch.jit.trace(model, x0)
    seen["traced"], seen["class"] = traced(x0).tolist(), traced.original_name
    # a module holding the model, the model's bound forward, given by keyword
    seen["held"] = torch.jit.trace(nn.Sequential(model), x0)(x0).tolist()
    seen["method"] = torch.jit.trace(func=model.forward, example_inputs=x0)(x0).tolist()
elif how == "export":
    traced = torch.export.export(model, (x0,)).module()
    seen["traced"], seen["class"] = traced(x0).tolist(), "Net"
else:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter("runs/traced") as writer:
        writer.add_graph(model, x0)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g))
for _ in range(2):
    for x, y in DataLoader(data, batch_size=8, shuffle=True):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
if how == "jit":  # the traced module holds the model's own weights, trained with it
    seen["traced_after"], seen["model_after"] = traced(x0).tolist(), by_hand(model, x0).tolist()
seen["weights"] = {k: v.tolist() for k, v in model.state_dict().items()}
with open(f"traced_rank{os.environ.get('RANK', '0')}.json", "w") as f:
    json.dump(seen, f)
