"""Validation metrics over uneven shards: every sample counted once, whatever the world size."""
import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import multigpu

rt = multigpu.setup(accelerator="cpu")
n = 7
labels = torch.arange(n) % 2
# Logits that are right for the first 5 samples and wrong for the last 2.
logits = torch.stack([torch.nn.functional.one_hot(labels, 2).float(),
                      1 - torch.nn.functional.one_hot(labels, 2).float()])
logits = torch.where((torch.arange(n) < 5)[:, None], logits[0], logits[1])
loader = rt.prepare(DataLoader(TensorDataset(logits, labels, torch.arange(n).float()), batch_size=2))
acc, mean, sums = multigpu.Accuracy(rt.env), multigpu.MeanMetric(rt.env), multigpu.Sums(rt.env)
for out, y, value in loader:
    acc.update(out, y)
    mean.update(value.mean(), len(value))
    sums.add(seen=len(y))
result = {"accuracy": acc.compute(), "mean": mean.compute(), "seen": sums.reduce()["seen"],
          "world_size": rt.world_size}
if rt.is_main:
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
