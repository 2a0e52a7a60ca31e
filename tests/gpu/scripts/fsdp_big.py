"""A model whose fp32 weights, gradients and Adam state (16 bytes a parameter) exceed one GPU's
memory, trained under fsdp on every GPU of the launch: `multigpu run --devices 2 fsdp_big.py`.

Its size follows the GPU: 16 bytes x parameters = 1.2x the GPU's memory, so ddp cannot hold it,
while fsdp on 2 GPUs keeps 8 bytes a parameter per GPU (0.6x) plus one gathered block. The model
is made on the GPU directly (a CPU init of billions of parameters takes minutes). Rank 0 prints
one JSON line with the sizes and every rank's peak memory.
"""
import json
import math

import torch
from torch import nn

import multigpu
from wide_blocks import Block  # next to this script


rt = multigpu.setup("fsdp", "bf16")
total = torch.cuda.get_device_properties(rt.device).total_memory
width = 8192
params = 1.2 * total / 16
blocks = math.ceil(params / (2 * width * width))
torch.manual_seed(0)
with torch.device(rt.device):
    model = nn.Sequential(*(Block(width) for _ in range(blocks)), nn.Linear(width, 16))
count = sum(p.numel() for p in model.parameters())
model, optimizer = rt.prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))
torch.cuda.reset_peak_memory_stats(rt.device)
x = torch.randn(8, width, device=rt.device)
y = torch.randint(0, 16, (8,), device=rt.device)
losses = []
for _ in range(3):
    with rt.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    rt.backward(loss)
    rt.step(optimizer)
    losses.append(loss.item())
peaks = rt.env.all_gather_object(torch.cuda.max_memory_allocated(rt.device) / 2**30)
rt.print(json.dumps({"parameters": count, "ddp_state_gib": 16 * count / 2**30,
                     "gpu_gib": total / 2**30, "peak_gib_per_gpu": peaks, "losses": losses,
                     "strategy": rt.strategy.describe()}))
