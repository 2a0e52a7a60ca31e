"""fp16 under fsdp on 2 processes: an inf in ONE rank's shard of the gradients makes EVERY rank
skip that optimizer step (each rank checks only its own shard). Prints, on rank 0, one JSON line
with each rank's count of skipped steps and whether every rank's shards were left unchanged.
"""
import json

import torch
from torch import nn

import multigpu
from fsdp_net import Net  # the model, next to this script

rt = multigpu.setup("fsdp", "fp16", accelerator="cpu", seed=0,
                    options=multigpu.FSDPOptions(min_params=100))
model, optimizer = rt.prepare(Net(), lambda params: torch.optim.SGD(params, lr=0.1))
x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
with rt.autocast():
    loss = nn.functional.cross_entropy(model(x), y)
rt.backward(loss)
before = [p.to_local().clone() for p in model.parameters()]
if rt.rank == 1:  # only this rank's shard of one gradient
    next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
rt.step(optimizer)
unchanged = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
report = rt.env.all_gather_object({"skipped": rt.precision.skipped_steps, "unchanged": unchanged})
rt.print(json.dumps(report))
