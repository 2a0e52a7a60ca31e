"""One real training step and one evaluation step of a `multigpu train` setup, on one device:
the parameters that get no gradient (trap 6), the peak memory of each (trap 2), and on a GPU the
largest per-GPU batch that fits (batchfit.py), and the run's time from more steps timed
(timing.py), all before any run starts.

The step is multigpu's own (engine.py's pieces, the Runtime's backward and step), in one process
with strategy single: DDP's buckets add about one copy of the gradients to the peak shown.
"""
from __future__ import annotations

import gc
import time

import torch

from multigpu.train import batchfit
from multigpu.train.settings.config import TrainConfig
from multigpu.core.findings import Finding
from multigpu.train.engine import prepare_inputs

GIB = 2**30
ESTIMATE = "estimate"  # the check the doctor's report leaves for its last line


def probe_findings(cfg: TrainConfig, plan, *, unused_fails: bool,
                   find_batch: bool = True) -> list[Finding]:
    """Findings of one step on the plan's first device (a GPU) or the CPU."""
    from multigpu.train.models.model_names import precision_for
    from multigpu.core.runtime import setup
    from multigpu.train.training import build_job

    cuda = plan.accelerator == "cuda"
    rt = setup("single", precision_for(cfg.numerics.precision, cfg.model), devices=[plan.gpu_ids[0]] if cuda else None,
               accelerator=plan.accelerator, seed=cfg.seed)
    job = build_job(cfg, rt)
    batch = next(iter(job.train_loader))
    findings = []
    started = time.perf_counter()
    try:
        unused, train_peak = _train_step(rt, job, batch)
    except torch.OutOfMemoryError:
        unused = None  # searched below, once the failed step's tensors are gone with the exception
    if unused is None:
        job.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return [_oom_finding(cfg, rt, job, batch) if find_batch else
                Finding("fail", "memory", f"one training step with --batch-size {cfg.input.batch_size} "
                                          f"runs out of memory on {rt.device}", trap=2)]
    step_seconds = time.perf_counter() - started
    findings.append(_unused_finding(unused, unused_fails and not cfg.parallel.find_unused_parameters))
    if not cuda:
        findings.append(Finding("ok", "memory", f"one step ran on the CPU in {step_seconds:.2f} s "
                                                "(host memory not checked)", trap=2))
        return findings + [_estimate_finding(cfg, plan, rt, job)]
    eval_peak = _eval_peak(rt, job)
    total = torch.cuda.get_device_properties(rt.device).total_memory
    findings.append(Finding("ok", "memory", f"peak on {rt.device} ({total / GIB:.0f} GiB) with "
                                            f"--batch-size {cfg.input.batch_size}: {train_peak / GIB:.2f} GiB "
                                            f"in a training step, {eval_peak / GIB:.2f} GiB in "
                                            "evaluation", trap=2))
    findings.append(_estimate_finding(cfg, plan, rt, job))  # before the search: it grows the batch
    if find_batch:
        findings.append(_fit_finding(cfg, rt, job, batch, total))
    return findings


def _estimate_finding(cfg, plan, rt, job) -> Finding:
    """The run's time, from steps timed here (timing.py); the doctor says it last."""
    from multigpu.doctor.timing import run_estimate

    return Finding("ok", ESTIMATE, run_estimate(cfg, plan, rt, job).line())


def _train_step(rt, job, batch) -> tuple[list[str], int]:
    """One forward, backward and optimizer step; (parameters without a gradient, peak bytes)."""
    model = job.model
    model.train()
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
        torch.cuda.reset_peak_memory_stats(rt.device)
    x, y = batch
    with rt.autocast():
        out = model(prepare_inputs(x, job.settings))
    rt.backward(job.loss_fn(out.float(), y))
    unused = [n for n, p in rt.strategy.unwrap(model).named_parameters()
              if p.requires_grad and p.grad is None]
    rt.step(job.optimizer)
    peak = 0
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
        peak = torch.cuda.max_memory_allocated(rt.device)
    return unused, peak


@torch.no_grad()
def _eval_peak(rt, job) -> int:
    job.model.eval()
    torch.cuda.reset_peak_memory_stats(rt.device)
    x, _ = next(iter(job.val_loader))
    with rt.autocast():
        job.model(prepare_inputs(x, job.settings))
    torch.cuda.synchronize(rt.device)
    return torch.cuda.max_memory_allocated(rt.device)


def _unused_finding(unused: list[str], fails: bool) -> Finding:
    if not unused:
        return Finding("ok", "unused params", "every trainable parameter got a gradient in one "
                                              "real step", trap=6)
    shown = ", ".join(unused[:6]) + (f" (+{len(unused) - 6} more)" if len(unused) > 6 else "")
    fix = ("remove the unused module, freeze it (requires_grad_(False)), or pass "
           "--find-unused-parameters (slower)")
    if fails:
        return Finding("fail", "unused params", f"{len(unused)} parameter(s) got no gradient: "
                                                f"{shown}; DDP stops at the second step: {fix}", trap=6)
    return Finding("warn", "unused params", f"{len(unused)} parameter(s) got no gradient: {shown}; "
                                            f"they never train: {fix}", trap=6)


def _fit_finding(cfg, rt, job, batch, total: int) -> Finding:
    fit = batchfit.largest_batch(lambda b: _try_batch(rt, job, batch, b), start=cfg.input.batch_size,
                                 limit=max(cfg.input.batch_size, batchfit.DEFAULT_LIMIT),
                                 budget=batchfit.HEADROOM * total)
    if fit.largest is None:
        return Finding("fail", "batch fit", f"not even --batch-size {cfg.input.batch_size} fits on "
                                            f"{rt.device}", trap=2)
    beyond = (f"; {fit.failed} ran out of memory" if fit.failed else
              f"; {fit.largest} is as far as the search goes")
    return Finding("ok", "batch fit", f"the largest per-GPU batch that fits on {rt.device}: "
                                      f"{fit.largest} (peak {fit.peak / GIB:.1f} of {total / GIB:.0f} "
                                      f"GiB, {1 - batchfit.HEADROOM:.0%} kept free){beyond}; "
                                      "--batch-size auto searches the same way in a run", trap=2)


def _oom_finding(cfg, rt, job, batch) -> Finding:
    fit = batchfit.largest_batch(lambda b: _try_batch(rt, job, batch, b), start=1,
                                 limit=cfg.input.batch_size - 1)
    fix = f"use --batch-size {fit.largest}" if fit.largest else "use a smaller model or --precision bf16"
    return Finding("fail", "memory", f"one training step with --batch-size {cfg.input.batch_size} runs "
                                     f"out of memory on {rt.device}: {fix} (add --accumulate to "
                                     "keep the global batch)", trap=2)


def _try_batch(rt, job, batch, size: int) -> int:
    """Peak bytes of one training step on `size` samples made of the probe's batch; raises
    torch.OutOfMemoryError."""
    x, y = batch
    try:
        return _train_step(rt, job, (batchfit.repeat_to(x, size), batchfit.repeat_to(y, size)))[1]
    except torch.OutOfMemoryError:
        job.optimizer.zero_grad(set_to_none=True)  # a backward cut short leaves some behind
        raise
