"""A user's script whose DataLoader starts its workers through Python's fork server: each rank
writes its pid and, from worker_init_fn, its workers' pids into PIDS_DIR, then reads slowly."""
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

PIDS = Path(sys.argv[1])


class Slow(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.zeros(4)


def note_worker(worker_id):
    (PIDS / f"rank{os.environ['RANK']}.worker{worker_id}").write_text(str(os.getpid()))


if __name__ == "__main__":  # the fork server imports this file again
    dist.init_process_group("gloo")
    loader = DataLoader(Slow(), batch_size=4, num_workers=2, multiprocessing_context="forkserver",
                        worker_init_fn=note_worker)
    for i, batch in enumerate(loader):
        if i == 0:
            (PIDS / f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
        time.sleep(0.05)
