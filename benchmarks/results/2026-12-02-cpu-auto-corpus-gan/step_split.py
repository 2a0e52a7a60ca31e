"""gan_step_exact.py's GAN step, but with shuffle=True so that --auto SPLITS the loader.
Reference (REF=1, one process): the same batches, in the order --auto's sampler makes
(randperm seeded torch.initial_seed() + epoch), batch 16 global."""
import json
import os
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
real = torch.randn(64, 6)
noise = torch.randn(64, 4)
G = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16, 0.8), nn.LeakyReLU(0.2), nn.Linear(16, 6), nn.Tanh())
D = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
if os.environ.get("NOBN"):
    G = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 6), nn.Tanh())
loss = nn.BCELoss()
oG = torch.optim.Adam(G.parameters(), lr=0.01, betas=(0.5, 0.999))
oD = torch.optim.Adam(D.parameters(), lr=0.01, betas=(0.5, 0.999))
ds = TensorDataset(real, noise)
ref = os.environ.get("REF") == "1"
loader = DataLoader(ds, batch_size=16, shuffle=True)
seed = torch.initial_seed()
losses = []
for epoch in range(3):
    if ref:
        order = torch.randperm(64, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        batches = [ds[order[i:i + 16]] for i in range(0, 64, 16)]
    else:
        batches = loader
    for x, z in batches:
        valid, fake = torch.ones(len(x), 1), torch.zeros(len(x), 1)
        oG.zero_grad()
        gen = G(z)
        g_loss = loss(D(gen), valid)
        g_loss.backward()
        oG.step()
        oD.zero_grad()
        d_loss = (loss(D(x), valid) + loss(D(gen.detach()), fake)) / 2
        d_loss.backward()
        oD.step()
        losses.append(d_loss.item())
out = {"G": [p.detach().flatten().tolist() for p in G.parameters()],
       "D": [p.detach().flatten().tolist() for p in D.parameters()], "d_loss": losses}
json.dump(out, open(sys.argv[1] + f"/w{os.environ.get('RANK', 'single')}.json", "w"))
