"""A plain torchrun + DDP script, converted to multigpu. What changed:

    -import os
    -import torch.distributed as dist
    -from torch.nn.parallel import DistributedDataParallel as DDP
    -from torch.utils.data.distributed import DistributedSampler
    +import multigpu
    -dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    -local_rank = int(os.environ["LOCAL_RANK"])
    -device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    -if device.type == "cuda":
    -    torch.cuda.set_device(device)
    -torch.manual_seed(0)                           # the same initial weights on every rank
    +rt = multigpu.setup(seed=0)                    # process group, device, seeds
    -sampler = DistributedSampler(dataset, shuffle=True)
    -loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    -model = DDP(model.to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    +loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    +model, optimizer, loader = rt.prepare(model, optimizer, loader)
     for epoch in range(args.epochs):
    -    sampler.set_epoch(epoch)                   # forgetting it repeats epoch 0's order
         for x, y in loader:
    -        x, y = x.to(device), y.to(device)
             loss = loss_fn(model(x), y)
    -        optimizer.zero_grad()
    -        loss.backward()
    -        optimizer.step()
    +        rt.backward(loss)
    +        rt.step(optimizer)                     # step, then zero the gradients
    -    if dist.get_rank() == 0:                   # rank 0's loss only, not the mean over ranks
    -        print(f"epoch {epoch}: loss {loss.item():.4f}")
    +    rt.print(f"epoch {epoch + 1}: loss {mean_loss.compute():.4f}")   # over every sample
    -if dist.get_rank() == 0:
    -    torch.save(model.module.state_dict(), "model.pt")   # the module. prefix trap
    -dist.barrier()
    -dist.destroy_process_group()
    +rt.save("model.pt", model=model, optimizer=optimizer)

Beyond fewer lines: DistributedSampler pads the last batch with repeated samples (so metrics
count some twice) and multigpu's loaders do not; the loss is averaged over the real samples of
each step; the checkpoint loads into a bare model.

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py      # still runs under plain torchrun
    multigpu run --devices cpu:2 examples/torchrun_ddp.py     # or multigpu's launcher
    multigpu run examples/torchrun_ddp.py                     # every free GPU
"""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multigpu

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--samples", type=int, default=2000)
parser.add_argument("--batch-size", type=int, default=32, help="per device")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--save", default=None, help="checkpoint path (default: no checkpoint)")
args = parser.parse_args()

rt = multigpu.setup(seed=0)

# Four Gaussian blobs in 16 dimensions: a classification problem that needs no download.
g = torch.Generator().manual_seed(0)
centers = 0.4 * torch.randn(4, 16, generator=g)
labels = torch.randint(0, 4, (args.samples,), generator=g)
features = centers[labels] + torch.randn(args.samples, 16, generator=g)
dataset = TensorDataset(features, labels)

model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
loss_fn = nn.CrossEntropyLoss()
loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
model, optimizer, loader = rt.prepare(model, optimizer, loader)

for epoch in range(args.epochs):
    mean_loss = multigpu.MeanMetric(rt.env)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        rt.backward(loss)
        rt.step(optimizer)
        mean_loss.update(loss.detach(), len(y))
    rt.print(f"epoch {epoch + 1}: loss {mean_loss.compute():.4f}")

if args.save:
    rt.save(args.save, model=model, optimizer=optimizer)
# DDP keeps the replicas equal: every rank prints the same sum (`multigpu run --tee` shows them).
checksum = sum(p.double().sum().item() for p in model.parameters())
print(f"rank {rt.rank}: weights checksum {checksum:.10f}", flush=True)
