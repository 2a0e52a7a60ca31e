"""Local rank 1 of the node started with FAIL_ONCE=<marker file> exits 1 before the process group
forms, once (the marker then exists); every rank then joins the group on gloo, checks an
all_reduce sum and writes what it saw, its restart count too."""
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
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "sum": t.item(),
               "restart": os.environ["TORCHELASTIC_RESTART_COUNT"]}, f)
dist.destroy_process_group()
