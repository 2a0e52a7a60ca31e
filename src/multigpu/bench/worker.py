"""Runs inside every process the bench launches: `python -m multigpu.bench.worker JOB.json`.

The job file lists tasks; each rank runs all of them in order (the same order on every rank, so
collectives line up), and appends one JSON line per task to <results_dir>/rank<RANK>.jsonl as soon
as the task is done, so a crash or a time limit keeps every finished measurement.

The multigpu methods go through exactly the code `multigpu train` runs: `multigpu.setup()`,
`rt.prepare()`, `training.make_optimizer()` and `engine.train_step()`; with --data real also
`training.build_job()` (datasets.load_data + make_loader + loader_workers + rt.prepare).
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

from multigpu import console
from multigpu.bench import measure
from multigpu.bench.measure import Prepared, synthetic_batch
from multigpu.bench.spec import Task


def _config(task: Task, strategy: str):
    from multigpu.config import TrainConfig

    data = task.data if task.data.startswith("folder:") else "digits"  # synthetic: unused by it
    return TrainConfig(model=task.model, data=data, batch_size=task.batch_size, optimizer="sgd",
                       lr=0.1, precision=task.precision, strategy=strategy,
                       image_size=task.image_size)


def _endless(loader):
    while True:  # a new epoch only if the data runs out (the bench sizes it so it does not)
        yield from loader


def build_multigpu(task: Task, accelerator: str, strategy: str) -> Prepared:
    from multigpu.engine import StepSettings, train_step
    from multigpu.models import build_model, is_convnet
    from multigpu.runtime import setup
    from multigpu.training import build_job, make_optimizer

    cfg = _config(task, strategy)
    rt = setup(strategy, task.precision, devices=list(range(task.gpus)) if strategy == "dp" else None,
               accelerator=accelerator, seed=0)
    if task.data.startswith("folder:"):  # the whole input pipeline, as `multigpu train` builds it
        _, model, optimizer, _, loader, _, settings = build_job(cfg, rt)
        batches = _endless(loader)
        queue = loader.loader.num_workers * (loader.loader.prefetch_factor or 0)

        def step() -> int:
            train_step(rt, model, optimizer, F.cross_entropy, next(batches), settings)
            return rt.step_info.global_count
        close = batches.close
    else:
        model = build_model(task.model, (3, task.image_size, task.image_size), task.num_outputs)
        settings = StepSettings(channels_last=rt.device.type == "cuda" and is_convnet(task.model))
        if settings.channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = rt.prepare(model)
        optimizer = make_optimizer(cfg, rt.strategy.unwrap(model), rt.device)
        per_process = task.batch_size * rt.strategy.devices_per_process  # dp: split over GPUs
        batch = synthetic_batch(per_process, task, rt.device, settings.channels_last, seed=1 + rt.rank)
        global_batch = per_process * rt.world_size

        def step() -> int:
            train_step(rt, model, optimizer, F.cross_entropy, batch, settings)
            return global_batch
        close, queue = None, 0
    devices = ([torch.device("cuda", i) for i in range(task.gpus)] if strategy == "dp"
               else [rt.device])
    info = {"precision": rt.precision.kind, "strategy": rt.strategy.describe(),
            "optimizer": measure.describe_optimizer(optimizer), "wrapper": type(model).__name__,
            "world_size": rt.world_size}
    return Prepared(step, devices, info, close, extra_warmup=queue)


def build(task: Task, accelerator: str) -> Prepared:
    from multigpu.bench.peers import BUILDERS

    strategies = {"multigpu-single": "single", "multigpu-dp": "dp", "multigpu-ddp": "ddp"}
    if task.method in strategies:
        return build_multigpu(task, accelerator, strategies[task.method])
    return BUILDERS[task.method](task, accelerator)


def task_devices(task: Task, accelerator: str) -> list[torch.device]:
    """The devices a task will use, known before it is built (to reset their memory counters)."""
    if accelerator != "cuda":
        return [torch.device("cpu")]
    if task.method == "multigpu-dp":
        return [torch.device("cuda", i) for i in range(task.gpus)]
    return [torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))]


def run_task(task: Task, accelerator: str) -> dict:
    devices = task_devices(task, accelerator)
    measure.release_memory(devices)
    before = measure.allocated(devices)
    start = time.perf_counter()
    prep = build(task, accelerator)
    setup_seconds = time.perf_counter() - start
    try:
        warmup = task.warmup + prep.extra_warmup
        seconds, samples = measure.time_trials(prep, warmup, task.steps, task.trials)
        peaks = measure.peak_allocated(devices)
    finally:
        if prep.close:
            prep.close()
    names = [torch.cuda.get_device_name(d) for d in devices if d.type == "cuda"]
    return {"kind": "task", "key": task.key, "rank": int(os.environ.get("RANK", "0")),
            "seconds": seconds, "samples": samples, "memory_before": before, "peak_memory": peaks,
            "device_names": names, "setup_seconds": setup_seconds, "warmup": warmup, **prep.info}


def environment(accelerator: str) -> dict:
    facts = {"kind": "meta", "hostname": platform.node(), "torch": torch.__version__,
             "cuda": torch.version.cuda, "python": platform.python_version(),
             "cpu_count": os.cpu_count(), "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    if accelerator == "cuda":
        nccl = torch.cuda.nccl.version()
        facts |= {"nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                  "cudnn": torch.backends.cudnn.version(),
                  "gpu_name": torch.cuda.get_device_name(torch.cuda.current_device()),
                  "driver_capability": ".".join(map(str, torch.cuda.get_device_capability()))}
    return facts


def configure_backends(accelerator: str) -> None:
    """The same global settings for every method of the process (and as BASELINE.md used)."""
    if accelerator == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # before any CUDA work
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest kernels once
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


@record
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(argv[0]).read_text())
    accelerator = job["accelerator"]
    rank = int(os.environ.get("RANK", "0"))
    console.configure(rank == 0)
    configure_backends(accelerator)
    out = Path(job["results_dir"]) / f"rank{rank}.jsonl"
    _append(out, environment(accelerator))
    for fields in job["tasks"]:
        task = Task(**fields)
        result = run_task(task, accelerator)
        _append(out, result)
        seconds = sum(result["seconds"])
        console.info(f"bench: {task.method} x{task.gpus} {task.model} batch {task.batch_size}: "
                     f"{sum(result['samples']) / seconds:,.0f} samples/s, "
                     f"{1000 * seconds / (task.steps * task.trials):.1f} ms/step "
                     "(rank 0's clock; the table uses the slowest rank)")
    from multigpu.distributed import destroy_distributed

    destroy_distributed()
    return 0


def _append(path: Path, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


if __name__ == "__main__":
    sys.exit(main())
