"""Post 001's train.py, converted to multigpu. Reads top to bottom.

The lines marked `# multigpu` are the whole conversion; everything else is the single-GPU script.

    python examples/train.py                              # one GPU (or the CPU)
    multigpu run --devices 4 examples/train.py            # 4 GPUs, DDP
    multigpu run --devices 0,3 examples/train.py          # GPUs 0 and 3
    multigpu run --devices cpu:2 examples/train.py        # 2 CPU processes, no GPU needed
    python examples/train.py --strategy dp                # nn.DataParallel over all GPUs
"""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

import multigpu                                                        # multigpu
from multigpu.train.data.datasets import load_data
from multigpu.train.models.catalog import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=32, help="per device")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--strategy", default="auto")
parser.add_argument("--precision", default="auto")
parser.add_argument("--save", default="digits_cnn.pt")
args = parser.parse_args()

rt = multigpu.setup(args.strategy, args.precision, seed=0)               # multigpu

data = load_data("digits", input_kind="image", image_size=8)
train_loader = DataLoader(data.train, batch_size=args.batch_size, shuffle=True)
test_loader = DataLoader(data.val, batch_size=args.batch_size)
net = build_model("cnn", data.input_shape, data.num_outputs)
loss_func = nn.CrossEntropyLoss()
optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
net, optimizer, train_loader, test_loader = rt.prepare(                  # multigpu
    net, optimizer, train_loader, test_loader)

for epoch in range(args.epochs):
    begin = time.time()
    net.train()
    train_acc = multigpu.Accuracy(rt.env)                                # multigpu
    for images, labels in train_loader:            # this rank's share, already on its device
        with rt.autocast():                                              # multigpu
            outputs = net(images)
            loss = loss_func(outputs.float(), labels)
        rt.backward(loss)                                                # multigpu
        rt.step(optimizer)                          # also zeroes the gradients   # multigpu
        train_acc.update(outputs.detach(), labels)
    scheduler.step()

    net.eval()
    test_acc = multigpu.Accuracy(rt.env)                                 # multigpu
    with torch.no_grad():
        for images, labels in test_loader:
            test_acc.update(net(images), labels)
    # Every sample counted once over all ranks; only rank 0 prints.
    rt.print(f"epoch {epoch + 1}: train accuracy {train_acc.compute():.2%}, "
             f"test accuracy {test_acc.compute():.2%}, {time.time() - begin:.1f} s")

rt.save(args.save, model=net, optimizer=optimizer, scheduler=scheduler, epoch=args.epochs)
rt.print(f"saved {args.save}: loads into a bare model with torch.load(..., weights_only=True)['model']")
