"""Runs inside every process the bench launches: `python -m multigpu.bench.worker JOB.json`.

The job file lists tasks; each rank runs all of them in order (the same order on every rank, so
collectives line up). Consecutive comparable tasks (same model, batch, image size, data, GPU count
and compile: only the method differs) form a set: each is built and warmed up in turn, then their
trials take turns (trial 1 of each, trial 2 of each, ...), so a drift of the machine over minutes
hits every method alike. Each rank appends JSON lines to <results_dir>/rank<RANK>.jsonl:
  {"kind": "begin", "phase": "build", "key"}   before a task is built (and warmed up);
  {"kind": "begin", "phase": "trials", "key", "keys"}   before a set's interleaved trials, with
      the key of its first task (the one a failure there is blamed on) and of all its tasks;
  {"kind": "task", "key", ...}   one per task when its set is done,
so a crash or a time limit keeps every finished set, and the parent knows what was running.

The multigpu methods go through exactly the code `multigpu train` runs: `multigpu.setup()`,
`rt.prepare()`, `training.make_optimizer()` and `engine.train_step()`; with --data real also
`training.build_job()` (datasets.load_data + make_loader + loader_workers + rt.prepare), and
the DDP settings of `training.ddp_options()`.
With --compile MODE the prepared model goes through torch.compile as in `multigpu train --compile
MODE`; it compiles (and records its CUDA graphs) in the warm-up steps. A variant
`multigpu-ddp:<name>` is the multigpu-ddp step with its spec.DDP_VARIANTS entry's changes to those
DDPOptions (passed to `multigpu.setup(ddp=)`) or communication hook.
"""
from __future__ import annotations

import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

from multigpu.train.settings import flagwords
from multigpu.core import console
from multigpu.bench import measure, realdata, telemetry
from multigpu.bench.measure import Prepared, synthetic_batch
from multigpu.bench.spec import OURS, OURS_PREFIX, Task, base_method, strategy_of, variant_of
from multigpu.core.strategies import STRATEGIES


def _config(task: Task, strategy: str):
    from multigpu.train.settings.config import TrainConfig
    from multigpu.train.models.model_names import precision_for

    data = task.data if task.data.startswith("folder:") else "digits"  # synthetic: unused by it
    return TrainConfig.from_flat(model=task.model, data=data, batch_size=task.batch_size,
                                 optimizer="sgd", lr=0.1,
                                 precision=precision_for(task.precision, task.model),
                                 strategy=strategy, image_size=task.image_size,
                                 compile=task.compile, decode=task.decode)


def build_multigpu(task: Task, accelerator: str, strategy: str) -> Prepared:
    from multigpu.train.engine import StepSettings, train_step
    from multigpu.train.models.catalog import build_model
    from multigpu.core.runtime import setup
    from multigpu.train.training import build_job, compile_prepared, make_optimizer, uses_channels_last

    cfg = _config(task, strategy)
    one_process = STRATEGIES[strategy].one_process  # drives its GPUs itself: name them
    rt = setup(strategy, cfg.numerics.precision, devices=list(range(task.gpus)) if one_process else None,
               accelerator=accelerator, seed=0, ddp=ddp_options(task), install_hooks=True)
    if task.data.startswith("folder:"):  # the whole input pipeline, as `multigpu train` builds it
        job = build_job(cfg, rt)
        model, optimizer, settings = job.model, job.optimizer, job.settings

        def train_one(batch) -> int:
            train_step(rt, model, optimizer, F.cross_entropy, batch, settings)
            return rt.step_info.global_count
        train = job.data.train
        decode = ("cpu" if not getattr(train, "on_gpu", False) else
                  f"gpu, workers {train.cpu_share:.0%}" if train.cpu_share else "gpu")
    else:
        model = build_model(task.model, (3, task.image_size, task.image_size), task.num_outputs)
        settings = StepSettings(channels_last=uses_channels_last(rt, task.model))
        if settings.channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = compile_prepared(cfg, rt, rt.prepare(model))  # unwrap() peels compile off
        optimizer = make_optimizer(cfg, rt.strategy.unwrap(model))
        per_process = task.batch_size * rt.strategy.devices_per_process  # dp: split over GPUs
        batch = synthetic_batch(per_process, task, rt.device, settings.channels_last, seed=1 + rt.rank)
        global_batch = per_process * rt.world_size

        def step() -> int:
            train_step(rt, model, optimizer, F.cross_entropy, batch, settings)
            return global_batch
        decode = None
    devices = rt.strategy.devices
    wrapped = getattr(model, "_orig_mod", model)  # the strategy's wrapper, not torch.compile's
    add_comm_hook(task, wrapped)
    info = {"precision": rt.precision.kind, "strategy": rt.strategy.describe(),
            "optimizer": measure.describe_optimizer(optimizer), "wrapper": type(wrapped).__name__,
            "world_size": rt.world_size, "decode": decode}
    if task.data.startswith("folder:"):  # timed in the pipeline's steady state: see realdata.py
        return realdata.loader_prepared(job.train_loader, train_one, devices, info)
    return Prepared(step, devices, info)


def ddp_options(task: Task):
    """The DDPOptions `multigpu train` uses, with a multigpu-ddp variant's changes on top."""
    from multigpu.train.training import ddp_options as train_options

    options = train_options(_config(task, "ddp"))
    variant = variant_of(task.method)
    return variant.apply(options) if variant else options


def add_comm_hook(task: Task, model: torch.nn.Module) -> None:
    """A variant's communication hook (bf16hook), on the DDP wrapper only (DDPVariant)."""
    variant = variant_of(task.method)
    if variant:
        variant.add_comm_hook(model)


def build(task: Task, accelerator: str) -> Prepared:
    from multigpu.bench.peers import BUILDERS

    method = base_method(task.method)  # multigpu-ddp:static is multigpu-ddp with other options
    if method.startswith(OURS_PREFIX):
        return build_multigpu(task, accelerator, method.removeprefix(OURS_PREFIX))
    return BUILDERS[task.method](task, accelerator)


def task_devices(task: Task, accelerator: str) -> list[torch.device]:
    """The devices a task will use, known before it is built (to reset their memory counters)."""
    if accelerator != "cuda":
        return [torch.device("cpu")]
    if task.method in OURS and strategy_of(task.method).one_process:  # dp: every GPU it drives
        return [torch.device("cuda", i) for i in range(task.gpus)]
    return [torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))]


def comparable(task: Task) -> tuple:
    """What tasks must share for their trials to be interleaved: the same work on the same devices,
    only the method differs. Under --compile the compiled multigpu methods take turns with the
    eager peers: that is the comparison a user makes. A real-data task is alone in its set (the
    method is part of its key): its loader would refill its queue while the others ran, and start
    each trial with batches it loaded off the clock. (The peers run on synthetic data only, but
    multigpu-ddp and its variants all read real data.)"""
    alone = (task.method, task.data_kind) if task.data_kind != "synthetic" else None
    return task.model, task.batch_size, task.image_size, task.data, task.gpus, alone


def interleave_sets(tasks: list[Task]) -> list[list[Task]]:
    """The tasks, in job order, cut into runs of consecutive comparable tasks."""
    return [list(run) for _, run in itertools.groupby(tasks, key=comparable)]


def start_run(task: Task, accelerator: str, build_fn) -> measure.Run:
    """Build a task on freshly released memory; memory_before is read right before the build."""
    devices = task_devices(task, accelerator)
    measure.release_memory(devices)
    before = measure.allocated(devices)
    start = time.perf_counter()
    prep = build_fn(task, accelerator)
    return measure.Run(task, prep, devices, before, time.perf_counter() - start,
                       task.warmup + prep.extra_warmup,
                       sampler=telemetry.Sampler.for_devices(prep.devices))


def run_set(tasks: list[Task], accelerator: str, begin, build_fn=build) -> list[dict]:
    """Build and warm up each task in turn, time their trials round robin, then close them all;
    one record per task. `begin(record)` writes the begin records (see the module docstring)."""
    runs: list[measure.Run] = []
    compiled = any(t.compile for t in tasks)
    if compiled:  # compile afresh: no guards or dynamic shapes carried over from another set
        torch.compiler.reset()
    try:
        for task in tasks:
            begin({"kind": "begin", "phase": "build", "key": task.key})
            runs.append(start_run(task, accelerator, build_fn))
            measure.warm_up(runs[-1])
        if len(tasks) > 1:
            begin({"kind": "begin", "phase": "trials", "key": tasks[0].key,
                   "keys": [t.key for t in tasks]})
        measure.time_round_robin(runs)
    finally:
        for run in runs:
            if run.prep.close:
                run.prep.close()
    records = [result(run, len(tasks)) for run in runs]
    if compiled:  # free the CUDA graphs' memory pool before the next set measures its memory
        runs.clear()
        torch.compiler.reset()
    return records


def result(run: measure.Run, interleaved: int) -> dict:
    """The task's record. peak_memory, memory_before, memory_held_by_others: see measure.Run;
    interleaved: how many tasks took turns in its set (1: timed alone)."""
    names = [torch.cuda.get_device_name(d) for d in run.devices if d.type == "cuda"]
    return {"kind": "task", "key": run.task.key, "rank": int(os.environ.get("RANK", "0")),
            "seconds": run.seconds, "samples": run.samples, "memory_before": run.memory_before,
            "peak_memory": run.peak, "memory_held_by_others": run.held_by_others,
            "device_names": names, "setup_seconds": run.setup_seconds, "warmup": run.warmup,
            "interleaved": interleaved, "gpu_trials": run.gpu_trials or None, **run.prep.info}


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
    console.configure(rank == 0, say=flagwords.say)
    configure_backends(accelerator)
    out = Path(job["results_dir"]) / f"rank{rank}.jsonl"
    _append(out, environment(accelerator))
    for tasks in interleave_sets([Task(**fields) for fields in job["tasks"]]):
        for task, rec in zip(tasks, run_set(tasks, accelerator, lambda r: _append(out, r))):
            _append(out, rec)
            seconds = sum(rec["seconds"])
            console.info(f"bench: {task.describe()}: "
                         f"{sum(rec['samples']) / seconds:,.0f} samples/s, "
                         f"{1000 * seconds / (task.steps * task.trials):.1f} ms/step "
                         "(rank 0's clock; the table uses the slowest rank)")
    from multigpu.core.distributed import destroy_distributed

    destroy_distributed(wait_for_peers=True)  # a clean end: see distributed.py
    return 0


def _append(path: Path, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


if __name__ == "__main__":
    sys.exit(main())
