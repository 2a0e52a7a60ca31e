"""GPU check: each rank takes cuda:LOCAL_RANK, reports its GPU's UUID, and all-reduces on NCCL."""
import json
import os
import sys

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank)
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
t = torch.ones(1, device=device)
dist.all_reduce(t)
props = torch.cuda.get_device_properties(device)
with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"uuid": str(getattr(props, "uuid", "")), "name": props.name,
               "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "sum": t.item(),
               "device_count": torch.cuda.device_count()}, f)
dist.destroy_process_group()
