"""A small convnet whose weights are channels_last (NHWC, as multigpu lays out convnets on GPUs),
prepared under the strategy given and trained 3 steps; FSDP2 shards only contiguous parameters.

    channels_last_convnet.py STRATEGY OUT.pt
"""
import sys

import torch
from torch import nn

import multigpu
from multigpu import FSDPOptions

strategy, out = sys.argv[1], sys.argv[2]
rt = multigpu.setup(strategy, accelerator="cpu", seed=0, options=FSDPOptions(min_params=100))
torch.manual_seed(0)
model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()), nn.Sequential(nn.Conv2d(8, 8, 3), nn.ReLU()),
                      nn.Flatten(), nn.Linear(128, 2)).to(memory_format=torch.channels_last)
model, optimizer = rt.prepare(model, lambda params: torch.optim.SGD(params, lr=0.1))
g = torch.Generator().manual_seed(1 + rt.rank)
for _ in range(3):
    x = torch.randn(4, 3, 8, 8, generator=g).contiguous(memory_format=torch.channels_last)
    loss = nn.functional.cross_entropy(model(x), torch.randint(0, 2, (4,), generator=g))
    rt.backward(loss)
    rt.step(optimizer)
rt.save(out, model=model, optimizer=optimizer)
