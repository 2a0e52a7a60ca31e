"""Loader workers start again and again while SIGTERM keeps coming to the whole process group (as
torchrun's agent and a sweep send a stop): none may die of it. The main process counts the signals
and goes on. Arguments: the start method (or default) and the epochs; prints the batches it got
and whether any signal came."""
import signal
import subprocess
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from multigpu.core.loading.loaders import shard_loader

STORM = ("import os, signal, time\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "while True:\n"
         "    os.killpg(0, signal.SIGTERM)\n"
         "    time.sleep(0.001)\n")


def main(context: str | None, epochs: int) -> None:
    received = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    # another process of the group sends them, as torchrun's agent or a sweep would
    storm = subprocess.Popen([sys.executable, "-c", STORM])
    data = TensorDataset(torch.arange(64.0))
    batches = 0
    try:
        for epoch in range(epochs):  # workers that are not persistent start again each epoch
            loader = shard_loader(DataLoader(data, batch_size=8, num_workers=2, multiprocessing_context=context),
                                  layout=(1, 0, 1), device=torch.device("cpu"),
                                  seed=0, on_step=lambda info: None)
            loader.set_epoch(epoch)
            batches += sum(1 for _ in loader)
    finally:
        storm.kill()
    print(batches, bool(received))


if __name__ == "__main__":  # spawn's workers import this file again
    main(None if sys.argv[1] == "default" else sys.argv[1], int(sys.argv[2]))
