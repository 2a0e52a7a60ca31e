"""A model whose fp32 weights, gradients and Adam state (16 bytes a parameter) exceed the GPU's
memory, trained on ONE GPU under fsdp with CPU offload (the shards and the optimizer in host
memory): `multigpu run --devices 1 fsdp_offload_big.py [FRACTION [GIB]]`.

FRACTION (default 1.05): 16 bytes x parameters as a multiple of the GPU's memory. GIB: the GPU
memory this process may allocate (torch's per-process fraction), in place of the whole card's; the
same test in minutes on any card (a whole H200 needs ~9 billion parameters and AdamW steps of
minutes on the CPU). The model is
made in host memory, where it stays: fully_shard moves one block at a time to the GPU. Prints
one JSON line with the sizes, the step times and the peak GPU memory.
"""
import json
import math
import sys
import time

import torch
from torch import nn

import multigpu
from wide_blocks import Block  # next to this script


fraction = float(sys.argv[1]) if len(sys.argv) > 1 else 1.05
rt = multigpu.setup("fsdp", "bf16", options=multigpu.FSDPOptions(cpu_offload=True))
total = torch.cuda.get_device_properties(rt.device).total_memory
if len(sys.argv) > 2:
    cap = float(sys.argv[2]) * 2**30
    torch.cuda.set_per_process_memory_fraction(cap / total, rt.device)
    total = int(cap)
width = 8192
blocks = math.ceil(fraction * total / 16 / (2 * width * width))
began = time.perf_counter()
with torch.device("meta"):  # no init here: nn.Linear's took 60-90 s for 5 billion values
    model = nn.Sequential(*(Block(width) for _ in range(blocks)), nn.Linear(width, 16))
model = model.to_empty(device="cpu")
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 0.01)
count = sum(p.numel() for p in model.parameters())
made = time.perf_counter() - began
# foreach=False: the foreach kernels make whole-model temporaries, too many GiB in host memory
model, optimizer = rt.prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False))
prepared = time.perf_counter() - began - made
torch.cuda.reset_peak_memory_stats(rt.device)
x = torch.randn(8, width, device=rt.device)
y = torch.randint(0, 16, (8,), device=rt.device)
losses, seconds = [], []
for _ in range(3):
    start = time.perf_counter()
    with rt.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    rt.backward(loss)
    rt.step(optimizer)
    losses.append(loss.item())
    seconds.append(round(time.perf_counter() - start, 1))
print(json.dumps({"parameters": count, "ddp_state_gib": round(16 * count / 2**30, 1),
                  "gpu_gib": round(total / 2**30, 1), "strategy": rt.strategy.describe(),
                  "peak_gpu_gib": round(torch.cuda.max_memory_allocated(rt.device) / 2**30, 2),
                  "made_s": round(made, 1), "prepare_s": round(prepared, 1),
                  "step_s": seconds, "losses": losses}), flush=True)
