"""pytorch/examples' ImageNet recipe (imagenet/main.py) reduced to its distributed path: one
process per GPU under torchrun, DistributedSampler, DistributedDataParallel, SGD with momentum and
weight decay, fp32 as that recipe trains (no autocast).

    torchrun --nproc_per_node N benchmarks/peers/examples_imagenet.py FOLDER --epochs 3
"""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (first: its clock starts the whole job)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402


def main():
    a = common.args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    train, val = common.datasets(a.folder)
    sampler = DistributedSampler(train)
    train_loader = DataLoader(train, batch_size=a.batch_size, sampler=sampler, num_workers=a.workers,
                              pin_memory=True)
    val_loader = DataLoader(val, batch_size=a.batch_size, sampler=DistributedSampler(val, shuffle=False),
                            num_workers=a.workers, pin_memory=True)
    model = DistributedDataParallel(common.model(len(train.classes)).cuda(local_rank), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), a.lr, momentum=0.9, weight_decay=1e-4)
    epochs = []
    for epoch in range(a.epochs):
        began = time.perf_counter()
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.cuda(local_rank, non_blocking=True), y.cuda(local_rank, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        torch.cuda.synchronize()
        epochs.append(time.perf_counter() - began)
        model.eval()
        counts = torch.zeros(2, device=local_rank)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.cuda(local_rank, non_blocking=True), y.cuda(local_rank, non_blocking=True)
                counts += torch.stack([(model(x).argmax(1) == y).sum(), torch.tensor(len(y), device=local_rank)])
        dist.all_reduce(counts)
    if dist.get_rank() == 0:
        common.report("pytorch-examples", epochs, float(counts[0] / counts[1]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
