"""An HF Accelerate script as its docs write it: its world as Accelerate sees it, and a sum over it."""
import json
import sys

import torch
from accelerate import Accelerator

acc = Accelerator()
total = acc.reduce(torch.tensor(float(acc.process_index + 1)), "sum")
with open(f"{sys.argv[1]}/rank{acc.process_index}.json", "w") as f:
    json.dump({"world": acc.num_processes, "type": str(acc.distributed_type), "sum": total.item()}, f)
