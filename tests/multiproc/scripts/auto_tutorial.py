"""A one-device training script as the tutorials write it, with no multigpu in it: a shuffled
DataLoader, model.to(device), SGD, a loop over epochs with a line per epoch, an evaluation loader
without shuffle, torch.save(model.state_dict()) at the end. `multigpu run --auto` runs it as it is.

For the tests only, it also writes what this process saw (seen_rank<RANK>.json: each step's sample
indices, the evaluation's sample count, the final weights, the GPUs it saw); a script of its own
would not, and nothing in it depends on being distributed.
"""
import argparse
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Indexed(Dataset):
    """A small regression set whose items carry their own index."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def build_model():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--dataparallel", action="store_true", help="wrap the model in nn.DataParallel")
    args = p.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_loader = DataLoader(Indexed(48, 1), batch_size=args.batch, shuffle=True)
    test_loader = DataLoader(Indexed(16, 2), batch_size=8)
    model = build_model().to(device)
    if args.dataparallel:
        model = nn.DataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    steps = []
    for epoch in range(args.epochs):
        model.train()
        for x, y, idx in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            steps.append([epoch, idx.tolist()])
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for x, y, idx in test_loader:
                total += nn.functional.mse_loss(model(x.to(device)), y.to(device), reduction="sum").item()
                count += len(idx)
        print(f"epoch {epoch}: test loss {total / count:.6f} over {count} samples")

    torch.save(model.state_dict(), "model.pt")

    record = {"steps": steps, "test_count": count,
              "weights": {k: v.cpu().tolist() for k, v in model.state_dict().items()},
              "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
              "device_count": torch.cuda.device_count(),
              "param_device": str(next(model.parameters()).device)}
    with open(f"seen_rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
