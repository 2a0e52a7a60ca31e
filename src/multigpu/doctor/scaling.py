"""Trap 4, measured: is N devices at this per-device batch faster than one?

`multigpu doctor --scaling` (train options, N > 1 devices; off by default: 30-60 s more on a
CPU) times a few steps of the run's model and batch on one device and on all of the plan's
devices, through `multigpu bench` (same step, launcher and turns), in a temporary folder, its
progress held back (shown where it failed; its warnings always), and ends with the speed-up,
after the estimate:

    scaling    1.86x on 2 devices (93 % of 2x one device); measured: 1 device 40.1 ms a step,
               2 devices 43.1 ms, 32 samples each, synthetic data (multigpu bench)

The arithmetic (speedup): each of the N devices trains a batch of the same size, so N devices
go through N batches in the time of one of their steps, one device through one in its own; the
speed-up is N x (one device's step) / (N devices' step), and the efficiency that over N. A
speed-up under POOR of linear is also a warning, with a larger batch to try. CPU processes share
the host's cores and memory bandwidth with each other (and on a shared machine with other work):
their figure says so.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

from multigpu.core.findings import Finding
from multigpu.core.system.held_output import held_output
from multigpu.train.settings.config import TrainConfig

POOR = 0.6  # scaling efficiency under which communication and waiting dominate
SCALING = "scaling"  # the check the doctor's report leaves for its last line, after the estimate
BENCH = "synthetic data (multigpu bench)"
SCRIPT = "the script's own steps from the second on, on rank 0's clock"


def speedup(one_step_s: float, n_step_s: float, n: int) -> tuple[float, float]:
    """(speed-up, efficiency) of `n` devices each at the same batch as one device: one step of
    one device takes `one_step_s`, one step of the n devices `n_step_s` (the slowest rank's)."""
    x = n * one_step_s / n_step_s
    return x, x / n


def scaling_line(one_step_s: float, n_step_s: float, n: int, *, batch: int | None, cpu: bool,
                 source: str = BENCH, cores: int | None = None) -> str:
    """The line said after the estimate (without its `scaling` head); `source`: how the steps
    were timed."""
    x, eff = speedup(one_step_s, n_step_s, n)
    each = f", {batch} samples each" if batch else ""
    said = (f"{x:.2f}x on {n} devices ({eff * 100:.0f} % of {n}x one device); measured: 1 device "
            f"{_ms(one_step_s)} a step, {n} devices {_ms(n_step_s)}{each}, {source}")
    if cpu:
        said += (f"; {n} CPU processes share this host's {cores or os.cpu_count()} cores (and "
                 "its other work): a noise-prone figure, not a GPU's")
    return said


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 1000 else f"{ms:.0f} ms"


def scaling_findings(cfg: TrainConfig, plan) -> list[Finding]:
    from multigpu.bench import BenchSettings, run_bench
    from multigpu.core.system.environ import environ_set

    n = len(plan.gpu_ids) if plan.accelerator == "cuda" else plan.nproc
    if n < 2:
        return [Finding("ok", SCALING, "one device: nothing to compare", trap=4)]
    folder, held = tempfile.mkdtemp(prefix="multigpu-doctor-"), None
    try:  # the bench's progress (its launches, their headers, rank 0's lines) held back
        with environ_set(_threads(plan)), held_output() as held:
            rep = run_bench(BenchSettings(
                models=(cfg.model,), batch_sizes=(cfg.input.batch_size,), precision=cfg.numerics.precision,
                gpus=(1, n), methods=("multigpu-single", "multigpu-ddp"), steps=10, warmup=3, trials=3,
                image_size=cfg.input.image_size, devices=cfg.devices, min_free_memory=cfg.min_free_memory,
                out=folder + "/"))
    except Exception:
        _show(held.text if held else "")  # what led up to the error the doctor ends with
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    stopped = ("interrupted", "stopped by a signal")  # bench's notes of a Ctrl-C or SIGTERM
    if any(note.startswith(stopped) for note in rep.get("notes", [])):
        raise KeyboardInterrupt  # Ctrl-C reached the timing: stop the doctor, as at any moment
    rows = rep.get("rows", [])
    one = next((r for r in rows if r["method"] == "multigpu-single" and r["gpus"] == 1), None)
    many = next((r for r in rows if r["method"] == "multigpu-ddp" and r["gpus"] == n), None)
    if not one or not many or not one.get("step_ms") or not many.get("step_ms"):
        _show(held.text)  # with the failed launch's error and the launcher's report
        return [Finding("warn", SCALING, f"the 1 vs {n} device timing did not finish (the bench's "
                                         f"output above says why); to run it alone: multigpu bench "
                                         f"--model {cfg.model} --batch-size {cfg.input.batch_size} "
                                         f"--devices {cfg.devices} --gpus 1,{n}", trap=4)]
    _show(held.warnings())  # the report is the doctor's; its warnings stay
    batch = cfg.input.batch_size
    one_s, many_s = one["step_ms"] / 1e3, many["step_ms"] / 1e3
    line = Finding("ok", SCALING, scaling_line(one_s, many_s, n, batch=batch, cpu=plan.accelerator != "cuda"))
    x, eff = speedup(one_s, many_s, n)
    if eff >= POOR:
        return [line]
    return [Finding("warn", "scaling poor", f"{n} devices train {x:.2f}x as fast as one at --batch-size "
                                            f"{batch} each ({eff:.0%} of linear): communication and "
                                            "waiting outweigh the work of so small a batch; use "
                                            f"--batch-size {batch * 4} (with a matching --lr) or "
                                            "fewer devices", trap=4), line]


def _show(text: str) -> None:
    """Held-back output of the bench, on stderr, before the doctor's report."""
    if text:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()


def script_scaling_findings(cmd: list[str], plan, steps: int, timeout: float,
                            records: list[dict]) -> list[Finding]:
    """`doctor --scaling -- script.py` on N > 1 devices: after the N-rank trial (its `records`),
    the same script on the plan's first device alone, up to the same step (script_trial.py), and
    the speed-up of their steps from the second on. The script's batch per rank is its own (the
    same on one rank), so the speed-up is that of N ranks each at that batch."""
    from multigpu.core.system.environ import environ_set
    from multigpu.doctor.script_trial import run_trial, step_samples

    many = step_samples(records)
    n = plan.nproc
    if not many:
        return [Finding("warn", SCALING, f"not measured: --scaling times the script's steps from the "
                                         f"second on, on one device and on {n}: give --steps 3 or more", trap=4)]
    with environ_set(_threads(plan)):
        run = run_trial(cmd, _one_device(plan), steps, timeout)
    one = step_samples(run.records)
    if run.code != 0 or not one:
        return [Finding("warn", SCALING, f"the script on one device did not reach optimizer step {steps} "
                                         f"(exit status {run.code}); its log is in {run.folder / 'logs'}",
                        trap=4)]
    shutil.rmtree(run.folder, ignore_errors=True)
    batch = next((r.get("batch") for r in run.records if r.get("batch")), None)
    return [Finding("ok", SCALING, scaling_line(sum(one) / len(one), sum(many) / len(many), n,
                                                batch=batch if isinstance(batch, int) else None,
                                                cpu=plan.accelerator != "cuda", source=SCRIPT))]


def _one_device(plan):
    """The plan's first device alone."""
    from dataclasses import replace

    return replace(plan, nproc=1, gpu_ids=plan.gpu_ids[:1], gpu_names=plan.gpu_names[:1],
                   tokens=plan.tokens[:1], lease_keys=plan.lease_keys[:1])


def _threads(plan) -> dict[str, str]:
    """CPU processes: one alone computes with the threads each of the run's N gets, as they do
    (with all of the cores, one process on 2 busy cores timed 757 ms a step against 2 processes'
    166: its threads waited for each other)."""
    from multigpu.doctor.timing import run_threads

    return {} if plan.accelerator == "cuda" else {"OMP_NUM_THREADS": str(run_threads(plan))}
