"""Trap 6 (post 002): a submodule that never takes part in the loss, under DDP."""
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multigpu


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.initial = nn.Linear(4, 4)  # defined, never used: the post's culprit
        self.body = nn.Linear(4, 2)

    def forward(self, x):
        return self.body(x)


find_unused = "--find-unused" in sys.argv
with_teacher = "--teacher" in sys.argv  # a second prepared model outside the loss: no error
rt = multigpu.setup("ddp", accelerator="cpu",
                    ddp=multigpu.DDPOptions(find_unused_parameters=find_unused))
ds = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
model = nn.Linear(4, 2) if with_teacher else Encoder()
model, loader = rt.prepare(model, DataLoader(ds, batch_size=2))
teacher = rt.prepare(nn.Linear(4, 2)) if with_teacher else None
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    if teacher is not None:
        with torch.no_grad():
            teacher(x)
    rt.backward(nn.functional.cross_entropy(model(x), y))
    rt.step(opt)
rt.print("finished")
