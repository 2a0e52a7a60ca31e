"""A VAE-style one-device script whose loss is a sum over the batch, as pytorch/examples' VAE
writes it: F.binary_cross_entropy(..., reduction='sum'), plus here an nn.MSELoss(reduction='sum')
on the code, trained with plain SGD. The code is the encoder's mean (no sampling), so that one
process can replay the run exactly. `--kld` adds the VAE's KL term, a sum written by hand
(`torch.sum(...)`).

For the tests it writes seen_rank<RANK>.json: each step's sample indices and the final weights.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Pixels(Dataset):
    def __init__(self, n=48):
        self.x = torch.rand(n, 16, generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.mu, self.logvar = nn.Linear(16, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.dec = nn.Linear(4, 16)

    def forward(self, x):
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        return torch.sigmoid(self.dec(mu)), mu, logvar


latent_loss = nn.MSELoss(reduction="sum")


def loss_function(recon_x, x, mu, logvar, kld):
    loss = F.binary_cross_entropy(recon_x, x, reduction="sum")
    loss = loss + latent_loss(mu, torch.zeros_like(mu))
    if kld:
        loss = loss - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return loss


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kld", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    loader = DataLoader(Pixels(), batch_size=8, shuffle=True)
    model = VAE()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = []
    for epoch in range(2):
        train_loss = 0.0
        for x, idx in loader:
            optimizer.zero_grad()
            recon, mu, logvar = model(x)
            loss = loss_function(recon, x, mu, logvar, args.kld)
            loss.backward()
            train_loss += loss.item()
            optimizer.step()
            steps.append(idx.tolist())
        print(f"epoch {epoch}: average loss {train_loss / len(loader.dataset):.4f}")
    record = {"steps": steps, "weights": {k: v.tolist() for k, v in model.state_dict().items()}}
    with open(f"seen_rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
