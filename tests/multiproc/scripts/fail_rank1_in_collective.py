"""Rank 1 raises while rank 0 waits in an all_reduce: rank 0 then fails too, on the lost peer
(gloo: "Connection closed by peer"), an echo of rank 1's failure."""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    raise ValueError("boom-rank-1")
dist.all_reduce(torch.ones(1))
