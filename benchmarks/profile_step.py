"""Where does a data-parallel step lose time? Profile multigpu's own training step on each rank.

    torchrun --standalone --nproc_per_node 4 benchmarks/profile_step.py --out DIR [--variant NAME]

Runs `multigpu.train.engine.train_step` (ResNet-50, bf16, channels_last, synthetic data on the GPU),
profiles a few steps with torch.profiler and reduces each rank's kernel timeline to a handful of
numbers per step:
- wall_ms: the step as the host measures it (synchronised);
- busy_ms: time at least one kernel runs (the union of kernel intervals);
- compute_ms: the training stream's busy time (grows when NCCL steals SMs or bandwidth);
- nccl_ms: summed duration of NCCL kernels (includes time spent waiting for slower peers);
- exposed_nccl_ms: NCCL time during which no compute kernel runs (not overlapped);
- idle_ms: wall_ms - busy_ms (launch gaps, host overhead, waiting).
One JSON line per rank goes to DIR/profile-<variant>-rank<r>.json; rank 0 also prints its top kernels.
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import multigpu
from multigpu.train.engine import StepSettings, train_step
from multigpu.train.rundir.step_profile import kernel_times
from multigpu.bench.spec import DDP_VARIANTS
from multigpu.train.models.catalog import build_model
from multigpu.train.settings.config import TrainConfig
from multigpu.train.training import ddp_options

# "default" (multigpu train's DDP settings: training.ddp_options) or one of bench's multigpu-ddp:VARIANT settings.
VARIANTS = ("default", *DDP_VARIANTS)


def summarise(trace_path: Path, steps: int, wall_ms: float) -> dict:
    times = kernel_times(json.loads(trace_path.read_text())["traceEvents"], steps)
    return {"wall_ms": wall_ms, "busy_ms": times["gpu_busy_ms"],
            "compute_ms": times["training_stream_ms"], "nccl_ms": times["nccl_ms"],
            "exposed_nccl_ms": times["nccl_exposed_ms"], "idle_ms": wall_ms - times["gpu_busy_ms"],
            "kernels_per_step": times["kernels_per_step"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--variant", default="default", choices=sorted(VARIANTS))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tag", default="", help="label for this run, e.g. the NCCL settings in its env")
    p.add_argument("--no-profile", action="store_true", help="time only (no torch.profiler)")
    p.add_argument("--dp", type=int, default=0, help="DataParallel over this many GPUs instead")
    a = p.parse_args()

    torch.backends.cudnn.benchmark = True
    variant = DDP_VARIANTS.get(a.variant)  # None: "default"
    if a.dp:
        rt = multigpu.setup("dp", "bf16", seed=0, devices=list(range(a.dp)))
    else:
        options = ddp_options(TrainConfig(model=a.model))  # multigpu train's, as bench does
        options = variant.apply(options) if variant else options
        rt = multigpu.setup("auto", "bf16", seed=0, ddp=options)
    per_process = a.batch * rt.strategy.devices_per_process
    model = build_model(a.model, (3, 224, 224), 1000).to(memory_format=torch.channels_last)
    model = rt.prepare(model)
    if variant:
        variant.add_comm_hook(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    x = torch.randn(per_process, 3, 224, 224, device=rt.device)
    y = torch.randint(0, 1000, (per_process,), device=rt.device)
    settings = StepSettings(channels_last=True)
    loss_fn = torch.nn.functional.cross_entropy
    warmup, timed = (2, 2) if a.dp else (15, 20)
    for _ in range(warmup):
        train_step(rt, model, opt, loss_fn, (x, y), settings)
    torch.cuda.synchronize()

    t0 = time.perf_counter()
    for _ in range(timed):
        train_step(rt, model, opt, loss_fn, (x, y), settings)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / timed * 1000
    name = f"{a.variant}{a.tag}-{'dp' + str(a.dp) if a.dp else 'w' + str(rt.world_size)}-rank{rt.rank}"
    throughput = {"variant": a.variant, "tag": a.tag, "world_size": rt.world_size, "dp": a.dp,
                  "rank": rt.rank, "batch": a.batch, "model": a.model, "wall_ms": wall_ms,
                  "img_per_s": per_process * rt.world_size / wall_ms * 1000}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.no_profile:
        (out / f"time-{name}.json").write_text(json.dumps(throughput))
        print(json.dumps(throughput), flush=True)
        return
    trace = out / f"trace-{name}.json"
    steps = 1 if a.dp else a.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            train_step(rt, model, opt, loss_fn, (x, y), settings)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    result = {**throughput, **summarise(trace, steps, wall_ms)}
    trace.unlink()  # large; the summary is what we keep
    (out / f"profile-{name}.json").write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
    if rt.rank == 0:
        for key in ("cuda_time_total", "cpu_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=15), flush=True)


if __name__ == "__main__":
    # our GPU machines' rule (NVLink multicast off), read by NCCL when the process group starts;
    # multigpu itself does not set it
    for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(key, value)
    main()
