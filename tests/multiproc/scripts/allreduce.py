"""Joins the process group on gloo, checks world size and an all_reduce sum, writes the result."""
import json
import os
import sys

import torch
import torch.distributed as dist

out_dir, expected_world = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert world == expected_world, (world, expected_world)
assert t.item() == world * (world + 1) / 2, t.item()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "sum": t.item(),
               "group_rank": os.environ["GROUP_RANK"]}, f)
dist.destroy_process_group()
