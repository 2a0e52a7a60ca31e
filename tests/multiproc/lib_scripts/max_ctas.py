"""DDPOptions(nccl_max_ctas=...) on GPUs: the same training as the default DDP, fewer SMs for NCCL.

Two copies of one model train side by side on the same batches, one with NCCL's choice of thread
blocks and one in a group capped at 2; rank 0 prints one JSON line with the largest difference
between their weights, whether the capped model really uses a group of its own, and the maxCTAs
that group's NCCL communicator was configured with.
"""
import json

import torch
from torch import nn

import multigpu
from multigpu.core.strategies import DDPOptions
from multigpu.core.strategies.ddp import DDP

rt = multigpu.setup("ddp", accelerator="cuda", seed=0)
torch.manual_seed(0)
base = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
copy = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
copy.load_state_dict(base.state_dict())
default = rt.prepare(base)
capped = DDP(rt.env, DDPOptions(nccl_max_ctas=2)).setup_module(copy)
opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (default, capped)]
g = torch.Generator().manual_seed(1 + rt.rank)
for _ in range(5):
    x = torch.randn(32, 64, generator=g).to(rt.device)
    y = torch.randint(0, 10, (32,), generator=g).to(rt.device)
    for model, opt in zip((default, capped), opts):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
diff = max((a - b).abs().max().item() for a, b in zip(default.parameters(), capped.parameters()))
if rt.is_main:
    nccl = capped.process_group._get_backend(torch.device("cuda"))  # what NCCL was configured with
    print(json.dumps({"max_diff": diff, "own_group": capped.process_group is not default.process_group,
                      "max_ctas": nccl.options.config.max_ctas, "world_size": rt.world_size}))
