"""On NCCL, rank 1 skips the fourth all-reduce; rank 0 then waits for it in .item()."""
import os
import time

import torch
import torch.distributed as dist


def after_skipping():
    time.sleep(600)


local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
t = torch.ones(1, device="cuda")
for _ in range(3):
    dist.all_reduce(t)
torch.cuda.synchronize()
if dist.get_rank() == 1:
    after_skipping()
dist.all_reduce(t)
print(t.item())
