"""What the straggler timing (core/stragglers.py) costs a training step: the same DDP run on two
CPU processes with MULTIGPU_STRAGGLERS=0 (nothing timed) and =1 (the default), in turns.

    python benchmarks/stragglers_cost.py --turns 3

The worker (the same file with --worker, started by `multigpu run --devices cpu:2`) trains an MLP
of 48 parameter tensors (24 Linear layers: 48 post-accumulate-grad hooks a step, more than most
models' per-bucket work) on in-memory data, batch 16, 4 epochs of 64 steps; it says the mean
step of epochs 2-4 (the first holds the start-up) on rank 0. Runs compared within one call only.
First, the host work the timing's calls add to a step, timed in a loop of them (hook_cost): on a
machine shared with other work the whole steps of two runs differ by more than that.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker() -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import multigpu

    torch.set_num_threads(1)
    rt = multigpu.setup("ddp", accelerator="cpu", seed=0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(2048, 64, generator=g), torch.randn(2048, 64, generator=g))
    layers = [m for _ in range(24) for m in (nn.Linear(64, 64), nn.ReLU())]
    model, loader = rt.prepare(nn.Sequential(*layers), DataLoader(data, batch_size=16, shuffle=True))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seconds, steps = [], 0
    for epoch in range(4):
        began = time.perf_counter()
        for x, y in loader:
            rt.backward(nn.functional.mse_loss(model(x), y))
            rt.step(opt)
            steps += epoch > 0
        rt.env.barrier()
        seconds.append(time.perf_counter() - began)
    if rt.is_main:
        print("RESULT " + json.dumps({"step_ms": sum(seconds[1:]) * 1e3 / steps,
                                      "epochs_s": [round(s, 3) for s in seconds]}), flush=True)


def hook_cost(params: int = 48, steps: int = 20000) -> float:
    """Microseconds of host work the timing adds to one step on a CPU: the forward's mark, one
    gradient hook per parameter, the loader's wait, the batch's record (the same calls the hooks
    make, in a loop), epochs of 64 steps with their medians."""
    from types import SimpleNamespace

    import torch

    from multigpu.core.stragglers import Stragglers

    watch = Stragglers(SimpleNamespace(world_size=2, rank=0, local_rank=0, is_main=True,
                                       all_gather_object=lambda o: [o, o]), torch.device("cpu"))
    tensors = [torch.zeros(1) for _ in range(params)]
    began = time.perf_counter()
    for step in range(steps):
        watch.waited(1e-4)
        watch._forward(None, ())
        for t in tensors:
            watch._grad_ready(t)
        if step % 64 == 63:
            watch.epoch_end(step // 64)
    return (time.perf_counter() - began) * 1e6 / steps


def one_run(on: bool) -> dict:
    env = {**os.environ, "MULTIGPU_STRAGGLERS": "1" if on else "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "multigpu", "run", "--devices", "cpu:2", __file__, "--worker"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"the run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=3)
    args = p.parse_args()
    print(f"host work the timing adds a step (48 parameters, in a loop): {hook_cost():.1f} us", flush=True)
    runs = {False: [], True: []}
    for turn in range(args.turns):
        for on in (False, True):
            result = one_run(on)
            runs[on].append(result["step_ms"])
            print(f"turn {turn + 1}  stragglers {'on ' if on else 'off'}  {result['step_ms']:.3f} ms a step  "
                  f"epochs {result['epochs_s']} s", flush=True)
    off, on = statistics.median(runs[False]), statistics.median(runs[True])
    print(f"median: off {off:.3f} ms, on {on:.3f} ms a step: {on - off:+.3f} ms ({(on - off) / off:+.1%})")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        sys.exit(main())
