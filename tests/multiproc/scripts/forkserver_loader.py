"""A user's script whose DataLoader starts its workers through Python's fork server: each rank
writes its pid and, from worker_init_fn, its workers' pids into PIDS_DIR, then reads slowly: each
worker serves a few items, then stalls inside __getitem__, where torch's worker loop cannot notice
that its parent is gone (so what ends it is the launcher, not the worker itself). No process group
of its own, so that it runs unchanged under `multigpu run` and `multigpu run --auto`."""
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

PIDS = Path(sys.argv[1])


class Slow(Dataset):
    served = 0  # in each worker process

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        Slow.served += 1
        time.sleep(0.01 if Slow.served <= 20 else 60)
        return torch.zeros(4)


def note_worker(worker_id):
    (PIDS / f"rank{os.environ['RANK']}.worker{worker_id}").write_text(str(os.getpid()))


if __name__ == "__main__":  # the fork server imports this file again
    loader = DataLoader(Slow(), batch_size=4, num_workers=2, multiprocessing_context="forkserver",
                        worker_init_fn=note_worker)
    for i, _ in enumerate(loader):
        if i == 0:
            (PIDS / f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
        time.sleep(0.05)
