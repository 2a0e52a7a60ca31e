"""A small model trained with the library under a strategy given on the command line; used to
compare fsdp with ddp, and to move checkpoints between strategies and process counts.

    fsdp_train.py STRATEGY EPOCHS OUT.pt [--resume CKPT] [--accumulate N] [--sharded-save] ...

Trains EPOCHS epochs (0: only loads --resume) of 44 samples, batch 4 per process, AdamW with
gradient clipping, then saves OUT.pt with rt.save. Rank 0 prints one JSON line: the strategy's
description, the optimizer's class and the shard units.
"""
import argparse
import json

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multigpu
from multigpu import FSDPOptions

from fsdp_net import Net  # the model, next to this script

parser = argparse.ArgumentParser()
parser.add_argument("strategy")
parser.add_argument("epochs", type=int)
parser.add_argument("out")
parser.add_argument("--resume")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--accelerator", default="cpu")
parser.add_argument("--recompute", action="store_true", help="FSDPOptions(activation_checkpointing)")
parser.add_argument("--offload", action="store_true", help="FSDPOptions(cpu_offload)")
parser.add_argument("--sharded-save", action="store_true", help="rt.save(..., sharded=True)")
parser.add_argument("--optimizer-first", choices=["after-model", "before-model", "not-prepared"],
                    help="build the optimizer before prepare(), as a DDP script does, and pass it "
                         "after or before the model")
args = parser.parse_args()


rt = multigpu.setup(args.strategy, accelerator=args.accelerator, seed=0, accumulate=args.accumulate,
                    options=FSDPOptions(min_params=100, activation_checkpointing=args.recompute,
                                        cpu_offload=args.offload))
g = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(44, 6, generator=g), torch.randint(0, 3, (44,), generator=g))
loader = DataLoader(data, batch_size=4, shuffle=True)
model = Net()
forwards = [0]  # of the blocks' layers, recomputations in the backward included
for block in model.blocks:
    block.fc.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
make = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)  # noqa: E731
if args.optimizer_first == "after-model":
    model, optimizer, loader = rt.prepare(model, make(model.parameters()), loader)
elif args.optimizer_first == "before-model":
    optimizer, model, loader = rt.prepare(make(model.parameters()), model, loader)
elif args.optimizer_first == "not-prepared":  # never given to prepare(): caught at rt.step
    optimizer = make(model.parameters())
    model, loader = rt.prepare(model, loader)
else:
    model, optimizer, loader = rt.prepare(model, make, loader)
if args.resume:
    rt.load(args.resume, model=model, optimizer=optimizer)
for _ in range(args.epochs):
    for x, y in loader:
        with rt.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        rt.backward(loss)
        rt.step(optimizer, clip_grad_norm=0.5)
rt.save(args.out, model=model, optimizer=optimizer, sharded=args.sharded_save)
units = getattr(rt.strategy, "units", [])
rt.print(json.dumps({"strategy": rt.strategy.describe(), "units": units,
                     "world_size": rt.world_size, "block_forwards": forwards[0]}))
