"""Do CUDA graphs (torch.compile mode="reduce-overhead") lift the host-bound small-batch step?

    python -m torch.distributed.run --standalone --nproc_per_node N benchmarks/cudagraph_probe.py \
        --out DIR [--batch-size 32] [--modes eager,default,reduce-overhead]

At per-GPU batch 32 a ResNet-50 bf16 step on an H200 takes ~20 ms on one GPU and ~25 ms on two
(bench run 12), most of it the host launching kernels. CUDA graphs replay the whole kernel
sequence with one launch. This probe runs multigpu.engine.train_step (the step of `multigpu
train`) with the DDP settings of `multigpu train`, on the model compiled in each mode in turn
(eager = not compiled), and times --rounds rounds of --steps steps per mode, the slowest rank's
time kept. Before every step of a compiled mode it calls torch.compiler.cudagraph_mark_step_begin()
(each step's graph outputs may be overwritten by the next one). It records the compile time, the
step time (median, min, max), and torch's count of graphs that CUDA graphs skipped
(counters["inductor"]["cudagraph_skips"]) with the reasons torch logs (TORCH_LOGS=perf_hints).
Rank 0 writes DIR/cudagraph-w<N>.json and prints it.
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import multigpu
from multigpu.config import TrainConfig
from multigpu.engine import StepSettings, train_step
from multigpu.models import build_model
from multigpu.training import ddp_options
from noise_probe import timed  # benchmarks/, this script's folder, is on sys.path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--modes", default="eager,default,reduce-overhead")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    cfg = TrainConfig(model="resnet50", strategy="ddp")
    rt = multigpu.setup("auto", "bf16", accelerator="cuda", seed=0, ddp=ddp_options(cfg))
    torch.backends.cudnn.benchmark = True
    device, settings = rt.device, StepSettings(channels_last=True)
    b = args.batch_size
    x = torch.randn(b, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (b,), device=device)
    result = {"world_size": rt.world_size, "batch_size": b, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(device), "modes": {}}
    for mode in args.modes.split(","):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.manual_seed(0)
        model = build_model("resnet50", (3, 224, 224), 1000).to(memory_format=torch.channels_last)
        model = rt.prepare(model)
        if mode != "eager":
            model = torch.compile(model, mode=mode)
        opt = torch.optim.SGD(rt.strategy.unwrap(model).parameters(), lr=0.1, momentum=0.9,
                              fused=True)
        losses = []

        def step():
            if mode != "eager":
                torch.compiler.cudagraph_mark_step_begin()
            losses.append(train_step(rt, model, opt, F.cross_entropy, (x, y), settings))

        t0 = time.perf_counter()
        for _ in range(args.warmup):  # compiles (and records the graphs) here
            step()
        torch.cuda.synchronize(device)
        warmup_s = time.perf_counter() - t0
        ms = [1000.0 * timed(step, args.steps, device) / args.steps for _ in range(args.rounds)]
        med = statistics.median(ms)
        skips = dict(torch._dynamo.utils.counters["inductor"])
        result["modes"][mode] = {
            "warmup_s": round(warmup_s, 1), "median_ms": round(med, 3),
            "min_ms": round(min(ms), 3), "max_ms": round(max(ms), 3),
            "img_per_s": round(b * rt.world_size * 1000.0 / med, 1),
            "last_loss": round(float(torch.stack(losses[-5:]).mean()), 4),
            "cudagraph_skips": skips.get("cudagraph_skips", 0),
            "inductor_counters": {k: v for k, v in skips.items() if "cudagraph" in k}}
        if rt.is_main:
            print(mode, json.dumps(result["modes"][mode]), flush=True)
        del model, opt, losses
        torch.cuda.empty_cache()
    if rt.is_main:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"cudagraph-w{rt.world_size}.json").write_text(json.dumps(result, indent=1))
    multigpu.destroy_distributed()


if __name__ == "__main__":
    # our GPU machines' rule (NVLink multicast off), read by NCCL when the process group starts;
    # multigpu itself does not set it
    for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(key, value)
    main()
