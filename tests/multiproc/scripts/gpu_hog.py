"""Makes GPU 0 (as this process sees it) busy: takes all but ~1 GiB of its memory, then sleeps."""
import sys
import time

import torch

free, _ = torch.cuda.mem_get_info(0)
hog = torch.empty(max(0, free - 2**30), dtype=torch.uint8, device="cuda:0")
with open(sys.argv[1], "w") as f:
    f.write("ready")
time.sleep(600)
