"""A user's loop that saves inside an epoch and resumes: `resume_loader.py DIR stop|resume`.

`stop` trains 5 steps of epoch 0 and saves with the loader's position; `resume` (on any number of
processes) loads it and trains the rest of the epoch. Each rank logs the sample ids it trained.
"""
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import multigpu

out, mode = Path(sys.argv[1]), sys.argv[2]
rt = multigpu.setup(accelerator="cpu")
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, loader = rt.prepare(model, DataLoader(TensorDataset(torch.arange(50.0)), batch_size=3,
                                             shuffle=True))
if mode == "resume":
    loader.load_state_dict(rt.load(out / "ckpt.pt", model=model, optimizer=optimizer)["loader"])
seen = []
for step, (x,) in enumerate(loader):
    seen += x.long().tolist()
    rt.backward(model(x[:, None]).pow(2).mean())
    rt.step(optimizer)
    if mode == "stop" and step == 4:
        rt.save(out / "ckpt.pt", model=model, optimizer=optimizer, loader=loader.state_dict())
        break
(out / f"{mode}-rank{rt.rank}.json").write_text(json.dumps(seen))
