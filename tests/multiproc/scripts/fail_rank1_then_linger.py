"""Rank 1 raises and then takes long to exit (a non-daemon thread of its own, which Python joins
before the process ends); rank 0, waiting in an all_reduce, times out first and exits: the agent
then stops rank 1 with SIGTERM while it exits. Rank 1 still failed first."""
import datetime
import os
import threading
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
dist.barrier()
if os.environ["RANK"] == "1":
    threading.Thread(target=time.sleep, args=(60,)).start()
    raise ValueError("boom-rank-1")
dist.all_reduce(torch.ones(1))
