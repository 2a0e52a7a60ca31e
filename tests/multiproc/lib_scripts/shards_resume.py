"""A user's loop over multigpu.ShardedImages: `shards_resume.py SHARDS OUT full|stop|resume`.

`full` trains one epoch; `stop` trains 2 steps of it and saves with the loader's position;
`resume` (on any number of processes) loads that and trains the rest. Each rank logs the keys it
trained (OUT/MODE-rankR.json); rank 0 saves the weights at the end (OUT/MODE.pt).
"""
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import multigpu

shards, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]


class Keyed(Dataset):
    """The images and labels, and which sample each is (to log who trained what)."""

    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        x, y = self.images[i]
        return x, y, i


rt = multigpu.setup(accelerator="cpu", seed=7)
train = multigpu.ShardedImages(shards, "train", image_size=8)
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, loader = rt.prepare(model, DataLoader(Keyed(train), batch_size=2, shuffle=True,
                                             num_workers=1))
if mode == "resume":
    loader.load_state_dict(rt.load(out / "ckpt.pt", model=model, optimizer=optimizer)["loader"])
seen = []
for step, (x, y, i) in enumerate(loader):
    seen += [train.samples[k][0] for k in i.tolist()]  # SHARD:MEMBER
    rt.backward(torch.nn.functional.cross_entropy(model(x.float() / 255), y))
    rt.step(optimizer)
    if mode == "stop" and step == 1:
        rt.save(out / "ckpt.pt", model=model, optimizer=optimizer, loader=loader.state_dict())
        break
(out / f"{mode}-rank{rt.rank}.json").write_text(json.dumps(seen))
if mode != "stop" and rt.rank == 0:
    torch.save(multigpu.unwrap_model(model).state_dict(), out / f"{mode}.pt")
