"""An Accelerate-style training loop, written with multigpu. The calls map one to one:

    Accelerate                                   multigpu
    accelerator = Accelerator(mixed_precision=)  rt = multigpu.setup(precision="bf16")
    accelerator.prepare(model, opt, loaders)     rt.prepare(model, opt, loaders)
    accelerator.autocast()                       rt.autocast()
    accelerator.backward(loss)                   rt.backward(loss)
    optimizer.step(); optimizer.zero_grad()      rt.step(optimizer)   (clip_grad_norm= too)
    accelerator.gather_for_metrics(...)          multigpu.Accuracy / MeanMetric (every sample once)
    accelerator.print / is_main_process          rt.print / rt.is_main
    accelerator.save_state(dir)                  rt.save(path, model=, optimizer=, scheduler=)

    python examples/accelerate_style.py                          # one GPU or the CPU
    multigpu run --devices cpu:2 examples/accelerate_style.py    # 2 CPU processes
    multigpu run examples/accelerate_style.py --precision bf16   # every free GPU, bf16
"""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multigpu

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--samples", type=int, default=1200)
parser.add_argument("--val-samples", type=int, default=333)
parser.add_argument("--batch-size", type=int, default=16, help="per device")
parser.add_argument("--lr", type=float, default=1e-2)
parser.add_argument("--precision", default="fp32", help="fp32, bf16, fp16 or auto")
parser.add_argument("--save", default=None, help="checkpoint path (default: no checkpoint)")
args = parser.parse_args()


def make_data(n: int, seed: int) -> TensorDataset:
    """Points in the plane, labelled by which of three rings they fall in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g) * 1.5
    radius = x.norm(dim=1)
    y = (radius > 1.0).long() + (radius > 2.0).long()
    return TensorDataset(x, y)


rt = multigpu.setup(precision=args.precision, seed=0)
model = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
train_loader = DataLoader(make_data(args.samples, 0), batch_size=args.batch_size, shuffle=True)
val_loader = DataLoader(make_data(args.val_samples, 1), batch_size=args.batch_size)
model, optimizer, train_loader, val_loader = rt.prepare(model, optimizer, train_loader, val_loader)
loss_fn = nn.CrossEntropyLoss()

for epoch in range(args.epochs):
    model.train()
    for x, y in train_loader:
        with rt.autocast():
            loss = loss_fn(model(x).float(), y)
        rt.backward(loss)
        rt.step(optimizer, clip_grad_norm=1.0)
    scheduler.step()

    model.eval()
    accuracy, seen = multigpu.Accuracy(rt.env), multigpu.Sums(rt.env)
    with torch.no_grad():
        for x, y in val_loader:
            with rt.autocast():
                accuracy.update(model(x), y)
            seen.add(samples=len(y))
    # Both are collectives: every rank calls them; rank 0 prints.
    acc, samples = accuracy.compute(), int(seen.reduce()["samples"])
    rt.print(f"epoch {epoch + 1}: val accuracy {acc:.2%} over {samples} samples")

if args.save:
    rt.save(args.save, model=model, optimizer=optimizer, scheduler=scheduler, epoch=args.epochs)
    rt.print(f"saved {args.save}")
