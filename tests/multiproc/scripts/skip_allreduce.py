"""Rank 1 skips the fourth all-reduce and waits elsewhere: the job hangs."""
import time

import torch
import torch.distributed as dist


def after_skipping():
    time.sleep(600)


dist.init_process_group("gloo")
t = torch.ones(1)
for _ in range(3):
    dist.all_reduce(t)
if dist.get_rank() == 1:
    after_skipping()
dist.all_reduce(t)
