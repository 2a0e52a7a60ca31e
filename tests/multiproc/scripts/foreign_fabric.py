"""A Lightning Fabric script as its docs write it: its world as Fabric sees it, and a sum over it."""
import json
import sys

import torch
from lightning.fabric import Fabric

fabric = Fabric()
fabric.launch()
total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum")
with open(f"{sys.argv[1]}/rank{fabric.global_rank}.json", "w") as f:
    json.dump({"world": fabric.world_size, "type": type(fabric.strategy).__name__, "sum": total.item()}, f)
