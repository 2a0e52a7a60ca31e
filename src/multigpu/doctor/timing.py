"""`multigpu doctor`'s estimate of a `multigpu train` run (train/estimate.py says it): real
training steps of the run's model, data and batch timed on the probe's device, a few evaluation
batches and one checkpoint's pause, scaled to the run's steps per rank and epochs.

Each step is timed to its end on the device (doctor may wait for the GPU: it trains nothing), with
the loader's fetch in it; the first batches of each loader are not timed (its workers' start).
Evaluation batches and a checkpoint's pause are timed by the code that times them for train's
own estimate (run_estimate.eval_batch_seconds, checkpoints/pause.py).
The steps timed are at most MEASURE_STEPS and at most MEASURE_BUDGET_S of them (a large model
on a CPU), never fewer than MIN_STEPS. One device is timed in one process: the all-reduce of
several ranks, and their sharing of a CPU's cores, are not in it (LEAVES_OUT says so).
"""
from __future__ import annotations

import math
import os
import time

import torch

from multigpu.train.checkpoints.pause import checkpoint_pause
from multigpu.train.engine import train_step
from multigpu.train.estimate import Estimate, spread
from multigpu.train.run_estimate import eval_batch_seconds

MEASURE_STEPS = 20
MEASURE_BUDGET_S = 15.0
MIN_STEPS = 3
LEAVES_OUT = ("start-up", "a first epoch's compile (--compile)", "--decode auto's trial",
              "a cold page cache")


def run_threads(plan) -> int:
    """The CPU threads a process of the run computes with: what the launcher gives each one
    (launch_common: OMP_NUM_THREADS, else the cores shared out over the processes)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else max(1, (os.cpu_count() or 1) // plan.nproc)


def run_estimate(cfg, plan, rt, job) -> Estimate:
    """The estimate of the run `cfg` on the plan's devices, from steps on the probe's `rt`. On a
    CPU the steps are timed with the threads a run's process gets: with all of the cores, a
    process of 2 on 2 busy cores timed its steps 17x slower than the run then took."""
    sync = (lambda: torch.cuda.synchronize(rt.device)) if rt.device.type == "cuda" else (lambda: None)
    threads = torch.get_num_threads()
    if rt.device.type == "cpu":
        torch.set_num_threads(run_threads(plan))
    try:
        steps = _train_seconds(rt, job, sync)
        eval_batch = eval_batch_seconds(rt, job.model, job.val_loader, job.settings, sync) or 0.0
    finally:
        torch.set_num_threads(threads)
    ranks = plan.nproc
    per_step = cfg.input.batch_size * ranks * (len(plan.gpu_ids) if ranks == 1 and len(plan.gpu_ids) > 1 else 1)
    rounding = math.floor if cfg.input.drop_last else math.ceil
    batches = max(1, rounding(len(job.data.train) / per_step))
    val_batches = math.ceil(len(job.data.val) / per_step)
    devices = len(plan.gpu_ids) if plan.accelerator == "cuda" else ranks
    leaves = LEAVES_OUT + (("the all-reduce between devices (one device timed)",) if devices > 1 else ())
    return Estimate(sum(steps) / len(steps), spread(steps), len(steps), devices, plan.accelerator == "cuda",
                    batches=batches, epochs=cfg.epochs, eval_s=val_batches * eval_batch,
                    checkpoint_s=checkpoint_pause(rt, job), leaves_out=leaves)


def _batches(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def _train_seconds(rt, job, sync) -> list[float]:
    """Seconds of each timed training step (the batch's fetch included)."""
    job.model.train()
    batches = _batches(job.train_loader)
    train_step(rt, job.model, job.optimizer, job.loss_fn, next(batches), job.settings)  # the workers' start
    sync()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < MEASURE_STEPS and (len(times) < MIN_STEPS or time.perf_counter() - began < MEASURE_BUDGET_S):
        start = time.perf_counter()
        train_step(rt, job.model, job.optimizer, job.loss_fn, next(batches), job.settings)
        sync()
        times.append(time.perf_counter() - start)
    return times
