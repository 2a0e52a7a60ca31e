"""Where does the trial-to-trial noise of 4-GPU runs come from? One probe, every part in turns.

    python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/noise_probe.py \
        --out DIR [--rounds 30]

On the 4x H200 machines a 1-GPU trial repeats within 0.3 %, while 4-GPU trials of one launch spread
by up to 27 %, in episodes of seconds that hit every method alike, with the SM clocks at their
maximum throughout (bench's trial_gpu). Each round of this probe times, on all ranks at once and
started by a barrier, the parts of a DDP step separately:
  compute    ResNet-50 bf16 batch 128 forward, backward and SGD step, no communication
             (four single-GPU jobs side by side);
  allreduce  one all-reduce of ResNet-50's gradients (25.6 M fp32 values, ~100 MB) per step;
  ddp        multigpu.engine.train_step with the library's default DDPOptions, the two overlapped
             (these broadcast rank 0's buffers before every forward, as when run 8 measured it;
             `multigpu train` no longer does);
  host       a fixed pure-Python loop on the CPU, no GPU (host jitter, CPU steal);
each for --steps steps, the slowest rank's time kept. It also reads the CPU steal time of
/proc/stat over the round (a virtual machine's vCPUs waiting for the host). Rank 0 writes one
JSON line per round to DIR/noise-rounds.jsonl and a summary per part (median, min, max, spread)
to DIR/noise-summary.json, and prints the summary.
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import multigpu
from multigpu.engine import StepSettings, train_step
from multigpu.models import build_model

PARTS = ("compute", "allreduce", "ddp", "host")


def steal_jiffies() -> int:
    """CPU steal time of the whole machine so far (the 8th value of /proc/stat's cpu line)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


def timed(fn, steps: int, device) -> float:
    """Seconds for `steps` calls of fn on the slowest rank, started together (also used by
    cudagraph_probe.py, which may run as one process without a process group)."""
    if dist.is_initialized():
        dist.barrier(device_ids=[device.index])
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], device=device)
    if dist.is_initialized():
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    rt = multigpu.setup("ddp", "bf16", accelerator="cuda", seed=0)
    torch.backends.cudnn.benchmark = True
    device = rt.device
    settings = StepSettings(channels_last=True)

    def model_and_opt(prepare: bool):
        m = build_model("resnet50", (3, 224, 224), 1000).to(memory_format=torch.channels_last)
        m = rt.prepare(m) if prepare else m.to(device)
        params = rt.strategy.unwrap(m).parameters() if prepare else m.parameters()
        return m, torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)

    ddp_model, ddp_opt = model_and_opt(prepare=True)
    alone, alone_opt = model_and_opt(prepare=False)
    x = torch.randn(128, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (128,), device=device)
    grads = torch.zeros(25_557_032, device=device)  # ResNet-50's parameter count, fp32; zeros
    # stay zeros however often they are summed (the time does not depend on the values)

    def compute():
        with torch.autocast("cuda", torch.bfloat16):
            loss = F.cross_entropy(alone(x), y)
        loss.backward()
        alone_opt.step()
        alone_opt.zero_grad(set_to_none=True)

    def ddp():
        train_step(rt, ddp_model, ddp_opt, F.cross_entropy, (x, y), settings)

    def host():
        sum(i * i for i in range(200_000))

    fns = {"compute": compute, "allreduce": lambda: dist.all_reduce(grads), "ddp": ddp, "host": host}
    for fn in fns.values():  # warm-up: cuDNN tuning, NCCL buffers
        for _ in range(5):
            fn()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        steal0, t0 = steal_jiffies(), time.perf_counter()
        rec = {"round": r, **{name: 1000.0 * timed(fn, args.steps, device) / args.steps
                              for name, fn in fns.items()}}
        # jiffies are 1/100 s summed over every CPU: the share of all CPU time that was stolen
        stolen_s = (steal_jiffies() - steal0) / 100.0
        rec["steal_pct"] = 100.0 * stolen_s / ((time.perf_counter() - t0) * (os.cpu_count() or 1))
        rounds.append(rec)
        if rt.is_main:
            with open(out / "noise-rounds.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
    if rt.is_main:
        summary = {}
        for name in PARTS:
            ms = [rec[name] for rec in rounds]
            med = statistics.median(ms)
            summary[name] = {"median_ms": round(med, 3), "min_ms": round(min(ms), 3),
                             "max_ms": round(max(ms), 3),
                             "spread_pct": round(100.0 * (max(ms) - min(ms)) / med, 1)}
        summary["steal_pct_max"] = round(max(rec["steal_pct"] for rec in rounds), 2)
        (out / "noise-summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
    multigpu.destroy_distributed()


if __name__ == "__main__":
    # our GPU machines' rule (NVLink multicast off), read by NCCL when the process group starts;
    # multigpu itself does not set it
    for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(key, value)
    main()
