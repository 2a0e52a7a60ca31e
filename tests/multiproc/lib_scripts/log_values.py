"""rt.log on every rank of a 2-process run: rank 0 writes, the others only count the step.

argv: LOG_DIR. Each rank logs its rank as `rank` and the step times 10 as `train/loss` at steps
1..5, then `val/accuracy` once at step 5; rank 0's files must hold rank 0's values only.
"""
import sys

import torch

import multigpu

rt = multigpu.setup("ddp", accelerator="cpu", log_dir=sys.argv[1])
for step in range(1, 6):
    rt.log({"train/loss": torch.tensor(step * 10.0), "rank": rt.rank})
rt.log({"val/accuracy": 0.5}, step=5)
rt.print("logged")
