"""Rank 0 computes for SECONDS while rank 1 waits in a barrier: slow, not hung."""
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    end, x = time.time() + float(sys.argv[1]), 0
    while time.time() < end:
        x += sum(range(1000))
dist.barrier()
print("done", dist.get_rank(), flush=True)
