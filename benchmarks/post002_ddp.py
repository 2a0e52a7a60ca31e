"""Post 002's recipe, hand-written: the DDP script `multigpu train --model lstm` is compared with.

    python -m torch.distributed.run --nproc_per_node N benchmarks/post002_ddp.py \
        --csv FILE --seq-length 40 --future-length 1 --epochs 5 --batch-size 64 --out FILE.json

What seeds/002 does, on the same model and windows as `multigpu train --model lstm --data
timeseries:FILE` (multigpu's data and model builders; the training loop is the post's):
init_process_group (nccl on GPUs, gloo on CPU), DistributedSampler(shuffle=True) with set_epoch,
a DataLoader with that sampler, Adam, DistributedDataParallel(device_ids=[local_rank]); every 10
batches the loss is all-reduced, `torch.cuda.synchronize()` and `.item()` for the print, as the
post does; a validation pass per epoch (MSE, all-reduced). Rank 0 writes per-epoch seconds and
the whole run's time (from the start of the script) to --out.
"""
import argparse
import json
import os
import time

START = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from multigpu.train.data.datasets import load_data  # noqa: E402
from multigpu.train.models.seqmodels import build_sequence_model  # noqa: E402


def reduce_mean(t: torch.Tensor, world: int) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t / world


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--seq-length", type=int, default=40)
    p.add_argument("--future-length", type=int, default=1)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    if on_gpu:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    torch.manual_seed(0)

    data = load_data(f"timeseries:{a.csv}", input_kind="sequence", image_size=None,
                     seq_length=a.seq_length, future_length=a.future_length)
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(data.train, batch_size=a.batch_size, shuffle=False, sampler=sampler)
    val_loader = DataLoader(data.val, batch_size=a.batch_size,
                            sampler=DistributedSampler(data.val, num_replicas=world, rank=rank, shuffle=False))
    model = build_sequence_model("lstm", data.input_shape, data.num_outputs).to(device)
    optimizer = torch.optim.Adam([{"params": model.parameters()}], lr=a.lr)
    model = DDP(model, device_ids=[local_rank] if on_gpu else None, output_device=local_rank if on_gpu else None)
    loss_fn = torch.nn.MSELoss()

    epochs = []
    for epoch in range(a.epochs):
        began = time.perf_counter()
        sampler.set_epoch(epoch)
        model.train()
        epoch_loss = 0.0
        for batch_i, (x, y) in enumerate(train_loader):
            x, y = x.to(device), y.to(device)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if batch_i % 10 == 0:  # the post's print: reduce, synchronize, item
                reduced = reduce_mean(loss.detach(), world)
                if on_gpu:
                    torch.cuda.synchronize()
                epoch_loss += reduced.item()
        if on_gpu:
            torch.cuda.synchronize()
        trained = time.perf_counter() - began
        model.eval()
        total = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                total += torch.stack([loss_fn(model(x), y) * len(x), torch.tensor(float(len(x)), device=device)])
        dist.all_reduce(total)
        epochs.append({"epoch": epoch + 1, "train_s": trained, "seconds": time.perf_counter() - began,
                       "val_loss": float(total[0] / total[1]), "printed_loss": epoch_loss})
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"world_size": world, "device": str(device), "epochs": epochs,
                       "whole_s": time.perf_counter() - START}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
