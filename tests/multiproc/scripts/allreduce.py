"""Joins the process group on gloo, checks world size and an all_reduce sum, writes the result
(its node's rank and its restart count too). With FAIL_ONCE=<marker file>, local rank 1 exits 1
before the group forms, once (the marker then exists)."""
import json
import os
import sys

marker = os.environ.get("FAIL_ONCE")
if marker and os.environ["LOCAL_RANK"] == "1" and not os.path.exists(marker):
    open(marker, "w").close()
    print("failing once, on purpose", file=sys.stderr)
    sys.exit(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

out_dir, expected_world = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert world == expected_world, (world, expected_world)
assert t.item() == world * (world + 1) / 2, t.item()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "sum": t.item(), "group_rank": os.environ["GROUP_RANK"],
               "restart": os.environ["TORCHELASTIC_RESTART_COUNT"]}, f)
dist.destroy_process_group()
