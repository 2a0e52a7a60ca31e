"""A one-device script that writes its outputs the ways scripts do: os.makedirs, open(path, "w"),
PIL's Image.save, np.save, matplotlib's savefig, shutil.copyfile, torch.save(model, f) into a
file it opened, a scratch folder made then shutil.rmtree'd; then reads each back.

Each file's content names the process that wrote it (RANK; 0 for one process), and rank N writes
N/2 s after rank 0: where a rank's write reached the user's folder, it would be the one left
there. What each process read back goes to report_rank<RANK>.json in the temp folder."""
import json
import os
import shutil
import tempfile
import time

import matplotlib
import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x)


def train() -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
    for x, y in DataLoader(data, batch_size=12, shuffle=True):  # 2 or 3 processes
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def write(rank: int, model: nn.Module) -> None:
    os.makedirs("out/samples", exist_ok=True)
    with open("out/sample.txt", "w") as f:
        f.write(f"a sample of rank {rank}\n" * 2000)
    Image.new("L", (64, 64), color=rank * 100).save("out/samples/image.png")
    np.save("out/array.npy", np.full(1000, rank))
    fig = plt.figure(figsize=(2, 2))
    plt.plot([0, 1], [rank, rank])
    plt.title(f"rank {rank}")
    fig.savefig("out/plot.png")
    shutil.copyfile("out/sample.txt", "out/best.txt")
    with open("out/model.pt", "wb") as f:
        torch.save(model, f)
    os.makedirs("scratch/inner")
    with open("scratch/inner/part.txt", "w") as f:
        f.write(str(rank))
    shutil.rmtree("scratch")


def read_back(model: nn.Module) -> dict:
    loaded = torch.load("out/model.pt", weights_only=False)
    return {
        "sample": open("out/sample.txt").readline(),
        "best": open("out/best.txt").read() == open("out/sample.txt").read(),
        "pixel": Image.open("out/samples/image.png").getpixel((0, 0)),
        "array": np.load("out/array.npy").tolist()[:3],
        "plot": Image.open("out/plot.png").size,
        "model_class": type(loaded).__name__,
        "model_equal": all(torch.equal(a, b) for a, b in
                           zip(loaded.state_dict().values(), model.state_dict().values())),
        "out": sorted(os.listdir("out")),
        "scratch": os.path.exists("scratch"),
    }


if __name__ == "__main__":
    rank = int(os.environ.get("RANK", "0"))
    model = train()
    time.sleep(rank / 2)
    write(rank, model)
    report = read_back(model)
    with open(os.path.join(tempfile.gettempdir(), f"report_rank{rank}.json"), "w") as f:
        json.dump(report, f)
