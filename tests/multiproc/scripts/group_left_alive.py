"""A script that never calls destroy_process_group, as most scripts: at its own exit (atexit runs
after multigpu.worker has returned) it records whether its group was still alive then."""
import atexit
import json
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
rank = dist.get_rank()


def record():
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump({"sum": t[0].item(), "alive_at_exit": dist.is_initialized()}, f)


atexit.register(record)
