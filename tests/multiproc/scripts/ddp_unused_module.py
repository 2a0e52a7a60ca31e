"""A user's own DDP script whose model has a module unused in forward: both ranks fail on their
own at the second forward, with DDP's "Expected to have finished reduction" error."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 4)
        self.aux_head = nn.Linear(8, 4)  # never called

    def forward(self, x):
        return self.body(x)


dist.init_process_group("gloo")
model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
