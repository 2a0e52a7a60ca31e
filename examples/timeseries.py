"""Time-series forecasting with multigpu: windows of a series in, the next values out (post 002's
traffic model, in small). The series is synthetic (two seasonal sines, a trend and noise), so the
script needs no download; replace `make_series` with your own 1-D tensor.

    python examples/timeseries.py                              # one GPU or the CPU
    multigpu run --devices cpu:2 examples/timeseries.py        # 2 CPU processes
    multigpu run --devices 4 examples/timeseries.py --model lstm --history 96 --horizon 24

Windows are cut in time order: the last 20% of the series is the validation part, never seen in
training. The baseline repeats the last value of each window ("persistence"); a useful model
beats it.
"""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import multigpu

parser = argparse.ArgumentParser()
parser.add_argument("--length", type=int, default=3000, help="points in the series")
parser.add_argument("--history", type=int, default=48, help="input window")
parser.add_argument("--horizon", type=int, default=6, help="values to forecast")
parser.add_argument("--model", choices=["mlp", "lstm"], default="mlp")
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=64, help="per device")
parser.add_argument("--lr", type=float, default=3e-3)
args = parser.parse_args()


def make_series(length: int) -> torch.Tensor:
    t = torch.arange(length, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    return (torch.sin(2 * torch.pi * t / 24) + 0.5 * torch.sin(2 * torch.pi * t / 168)
            + 0.0005 * t + 0.1 * torch.randn(length, generator=g))


class Windows(Dataset):
    """(history values, next horizon values) pairs, one per start position."""

    def __init__(self, series: torch.Tensor, history: int, horizon: int):
        self.series, self.history, self.horizon = series, history, horizon

    def __len__(self) -> int:
        return len(self.series) - self.history - self.horizon + 1

    def __getitem__(self, i: int):
        cut = i + self.history
        return self.series[i:cut], self.series[cut:cut + self.horizon]


class LSTMForecaster(nn.Module):
    def __init__(self, horizon: int, hidden: int = 32):
        super().__init__()
        self.lstm = nn.LSTM(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, horizon)

    def forward(self, x):
        out, _ = self.lstm(x.unsqueeze(-1))
        return self.head(out[:, -1])


rt = multigpu.setup(seed=0)
series = make_series(args.length)
split = int(0.8 * len(series))
mean, std = series[:split].mean(), series[:split].std()  # statistics of the training part only
series = (series - mean) / std
train = Windows(series[:split], args.history, args.horizon)
val = Windows(series[split - args.history:], args.history, args.horizon)
if args.model == "lstm":
    model = LSTMForecaster(args.horizon)
else:
    model = nn.Sequential(nn.Linear(args.history, 128), nn.ReLU(), nn.Linear(128, args.horizon))
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
val_loader = DataLoader(val, batch_size=args.batch_size)
model, optimizer, train_loader, val_loader = rt.prepare(model, optimizer, train_loader, val_loader)

for epoch in range(args.epochs):
    model.train()
    for x, y in train_loader:
        loss = nn.functional.mse_loss(model(x), y)
        rt.backward(loss)
        rt.step(optimizer)

    model.eval()
    val_mse, baseline_mse = multigpu.MeanMetric(rt.env), multigpu.MeanMetric(rt.env)
    with torch.no_grad():
        for x, y in val_loader:
            val_mse.update(nn.functional.mse_loss(model(x), y), y.numel())
            persistence = x[:, -1:].expand_as(y)
            baseline_mse.update(nn.functional.mse_loss(persistence, y), y.numel())
    model_mse, base = val_mse.compute(), baseline_mse.compute()
    rt.print(f"epoch {epoch + 1}: val mse {model_mse:.4f} (persistence {base:.4f})")

rt.print(f"final: {len(val)} validation windows, model mse {model_mse:.4f}, "
         f"persistence mse {base:.4f}")
