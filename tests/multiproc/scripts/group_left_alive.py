"""A script that never calls destroy_process_group, as most scripts, and whose non-daemon thread
still all-reduces after the main code has ended (a late async save or logger does): the group
must still be there for it, and be gone only when the process exits."""
import json
import sys
import threading
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()


def late():
    time.sleep(1.0)
    t = torch.ones(4)
    dist.all_reduce(t)
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump({"late_sum": t[0].item()}, f)


threading.Thread(target=late).start()  # non-daemon: Python waits for it at exit
