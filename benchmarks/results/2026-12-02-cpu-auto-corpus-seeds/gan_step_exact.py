"""A GAN's step pattern with its noise inside the data (so it splits as the data does): two
optimizers, D used in G's loss, D called twice before one backward, BatchNorm1d(eps=0.8) in G."""
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
loss = nn.BCELoss()
oG = torch.optim.Adam(G.parameters(), lr=0.01, betas=(0.5, 0.999))
oD = torch.optim.Adam(D.parameters(), lr=0.01, betas=(0.5, 0.999))
loader = DataLoader(TensorDataset(real, noise), batch_size=16, shuffle=False)
for _epoch in range(3):
    for x, z in loader:
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
out = {"G": [p.detach().flatten().tolist() for p in G.parameters()],
       "D": [p.detach().flatten().tolist() for p in D.parameters()]}
json.dump(out, open(sys.argv[1] + f"/w{os.environ.get('RANK', 'single')}.json", "w"))
