"""A one-device training script that reads a stream (an IterableDataset), with no multigpu in it:
its items carry their own index, the loader's workers each read their share of the stream
(torch's get_worker_info, as torch's docs show), an evaluation pass over the same stream under
torch.no_grad() after each epoch. `multigpu run --auto` runs it as it is.

--sized gives the stream a __len__; --by-rank makes it shard itself by rank, as webdataset's
split_by_node does (item i to the rank reading i % WORLD_SIZE, from the environment), so that the
ranks' streams differ in length where --items does not divide.

For the tests only, it writes what this process saw (seen_rank<RANK>.json: each step's item
indices, the evaluation's item count, len(loader) where it has one, the final weights).
"""
import argparse
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class Stream(IterableDataset):
    """n regression items (x, y, index), made as they are read."""

    def __init__(self, n, by_rank=False):
        self.n, self.by_rank = n, by_rank

    def __iter__(self):
        start, step = 0, 1
        if self.by_rank:
            start, step = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        info = get_worker_info()
        if info is not None:  # each worker every num_workers-th of what this process reads
            start, step = start + info.id * step, step * info.num_workers
        for i in range(start, self.n, step):
            x = torch.sin(torch.arange(4.0) + i)
            yield x, x.sum(0, keepdim=True) * 0.5, i


class SizedStream(Stream):
    def __len__(self):
        return self.n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--items", type=int, default=45)
    p.add_argument("--batch", type=int, default=6)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--sized", action="store_true")
    p.add_argument("--by-rank", action="store_true")
    args = p.parse_args()

    torch.manual_seed(0)
    data = (SizedStream if args.sized else Stream)(args.items, args.by_rank)
    loader = DataLoader(data, batch_size=args.batch, num_workers=args.workers)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    steps, evaluated = [], []
    for epoch in range(args.epochs):
        for x, y, idx in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            steps.append([epoch, idx.tolist()])
        with torch.no_grad():
            evaluated.append(sum(len(idx) for _, _, idx in loader))
        print(f"epoch {epoch}: {sum(1 for e, _ in steps if e == epoch)} steps")

    record = {"steps": steps, "evaluated": evaluated,
              "len": len(loader) if args.sized else None,
              "weights": {k: v.tolist() for k, v in model.state_dict().items()}}
    with open(f"seen_rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
