"""A one-process script that draws noise for each sample in its training loop (as GANs do,
`np.random.normal(size=(batch, latent))`), seeding nothing. Writes to ARGV[1]/rankN.json what it
drew before training, in its training steps (with the indices of the samples it read), and its
weights at the end."""
import json
import os
import random
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1), torch.arange(32))
before = {"torch": torch.randn(3).tolist(), "numpy": np.random.rand(3).tolist(),
          "random": random.random()}
model = torch.nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
during = []
for epoch in range(2):
    for x, y, index in DataLoader(data, batch_size=8, shuffle=True):
        z = torch.randn(len(x), 3) * 0.01
        noise = np.random.normal(0, 0.01, size=(len(x), 1))
        during.append({"epoch": epoch, "index": index.tolist(), "torch": z.tolist(),
                       "numpy": noise.tolist(), "random": random.random()})
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x + z), y + torch.as_tensor(noise, dtype=torch.float32))
        loss.backward()
        optimizer.step()
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"before": before, "during": during, "weights": model.weight.tolist()}, f)
