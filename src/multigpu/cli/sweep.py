"""`multigpu sweep`: one command over a grid of settings, packed onto the free devices.

    multigpu sweep --grid seq_length=40,60,80 --grid future_length=1,4,8 --devices-per-run 2 \\
        --out sweeps/ts -- multigpu train --model lstm --data timeseries:co2 \\
        --seq-length {seq_length} --future-length {future_length}
    multigpu sweep sweep.yaml                 the same from a file (command:, grid:, include:,
                                              exclude:, and any of the options below)
    multigpu sweep --runs-per-gpu 4 sweep.yaml
                                              4 small runs share each GPU (default: as many as
                                              the first runs' peak memory allows)
    multigpu sweep --status sweeps/ts         where it stands
    multigpu sweep --resume sweeps/ts         go on with the sweep stored there
    multigpu sweep --on slurm --partition gpu --time 4h sweep.yaml
                                              the same runs as one SLURM job array (submitit);
                                              --status, the summary and a re-run work the same
    multigpu sweep --on slurm --nodes-per-run 2 --devices-per-run 8 sweep.yaml
                                              each run on 2 nodes of 8 GPUs

Running the same command again skips the finished runs and resumes the others from their
checkpoints. Results: DIR/summary.csv, summary.md and summary.png, updated as runs finish. A
`multigpu train` run on one device is forked from a process that has imported torch already, so
a small run pays seconds less to start.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from multigpu.core.errors import UsageError
from multigpu.cli.sweep_settings import (check_folder, check_nodes, default_per_run, number_option,
                                         parse_duration, resolve, runs_on)

# What a `multigpu train` run imports before its first step, in the order it does: the sweep's
# fork server imports them once (sweep/starter.py), so each one-device run forked from it skips them
WARM_PRELOAD = ("multigpu.cli", "multigpu.cli.train", "multigpu.train.trainloop", "torch._dynamo",
                "torch.utils.tensorboard", "matplotlib.pyplot")

DETACHED_ENV = "MULTIGPU_SWEEP_DETACHED"


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("sweep", help="run a command over a grid of settings, packed onto "
                              "the free GPUs, with a table and a plot",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2",
                   help="a setting and its values; repeat for more (every combination runs)")
    p.add_argument("--devices", metavar="SPEC", help="what the sweep may use: auto (every GPU, "
                   "or every CPU core for cpu:N runs), GPU ids 0,1,2,3, or cpu:K (K cores)")
    p.add_argument("--devices-per-run", metavar="N|cpu:N",
                   help="GPUs per run (default 1), or cpu:N CPU processes (default on a machine "
                        "without GPUs: cpu:1)")
    p.add_argument("--runs-per-gpu", type=int, metavar="K",
                   help="K runs of one GPU each share a GPU (default: as many as fit, from the "
                        "first run's peak memory; 1 for runs of several GPUs); with cpu:1 runs, K "
                        "runs share a core (default 1)")
    p.add_argument("--max-parallel", type=int, metavar="K",
                   help="at most K runs at once (default: as many as the devices allow; 1: one "
                        "after another)")
    p.add_argument("--timeout", metavar="TIME", help="stop a run after this long (90s, 30m, 2h); "
                   "it counts as failed")
    p.add_argument("--retries", type=int, metavar="N", help="start a failed run again up to N "
                   "times, from its checkpoint (default 0)")
    p.add_argument("--metric", metavar="NAME[:max|:min]", help="the number that ranks the runs "
                   "(default: the validation accuracy, MAE or loss of multigpu train)")
    p.add_argument("--min-free-memory", type=float, metavar="GB",
                   help="a GPU with less free memory counts as busy (default 2)")
    p.add_argument("--out", metavar="DIR", help="the sweep's folder (default: sweeps/<8 hex "
                   "digits of the sweep>, so the same command finds it again)")
    p.add_argument("--on", choices=("local", "slurm"), help="where the runs go: this machine "
                   "(default), or SLURM: one job array through submitit, each task a run with "
                   "--devices-per-run (default 1 GPU); the folder must be shared with the nodes")
    p.add_argument("--nodes-per-run", type=int, metavar="N", help="--on slurm: each run a job of N nodes "
                   "(default 1), with --devices-per-run on each; its command starts once per node")
    p.add_argument("--partition", metavar="P", help="--on slurm: the SLURM partition")
    p.add_argument("--time", metavar="TIME", help="--on slurm: each job's time limit (default "
                   "1h); a run stopped by it saves a checkpoint and is requeued to go on")
    p.add_argument("--slurm-arg", action="append", metavar="NAME=VALUE",
                   help="--on slurm: another sbatch option, e.g. account=abc, mem=64G; repeat")
    p.add_argument("--status", metavar="DIR", help="show where the sweep in DIR stands and exit")
    p.add_argument("--resume", metavar="DIR", help="go on with the sweep stored in DIR")
    p.add_argument("--detach", action="store_true", help="run in the background, also after "
                   "the terminal closes; follow it with --status, its log is DIR/sweep.log")
    p.add_argument("--dry-run", action="store_true", help="print each run's command and exit")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="[SWEEP.yaml] -- COMMAND ...",
                   help="a sweep file, and/or the command, with {name} placeholders")
    return p


def main(args: argparse.Namespace) -> int:
    from multigpu.sweep import state

    if args.status:
        return _status(Path(args.status))
    spec, options, root = resolve(args)
    folder = state.SweepFolder(root)
    nodes = check_nodes(options)
    if args.dry_run:
        return _dry_run(spec, options, folder)
    if runs_on(options) == "slurm":
        return _on_slurm(spec, options, folder, nodes)
    sweep = _build(spec, options, folder)
    if args.detach:
        return _detach(folder, sweep, options)
    if not folder.lock():
        raise UsageError(f"a sweep (pid {folder.holder_pid()}) is already working in {root}; "
                         f"follow it with: multigpu sweep --status {root}")
    try:
        return _execute(folder, sweep, options)
    finally:
        folder.unlock()


def _build(spec, options: dict, folder):
    from multigpu.sweep import spec as specs
    from multigpu.sweep.pool import make_pool
    from multigpu.sweep.scheduler import Options, Sweep

    runs = specs.expand(spec)
    check_folder(spec, folder)
    per_run = options.get("devices_per_run") or default_per_run()
    min_free = number_option(options, "min_free_memory", float, 2.0, 0)
    slots = number_option(options, "runs_per_gpu", int, None, 1)
    pool = make_pool(str(options.get("devices") or "auto"), str(per_run), min_free, slots)
    max_parallel = number_option(options, "max_parallel", int, None, 1)
    retries = number_option(options, "retries", int, 0, 0)
    metric = options.get("metric")
    if metric is not None and not isinstance(metric, str):
        raise UsageError(f"metric {metric!r}: give a metric's name, e.g. val_mae or val_accuracy")
    opts = Options(max_parallel=max_parallel, timeout_s=parse_duration(options.get("timeout")),
                   retries=retries, metric=metric)
    return Sweep(spec, runs, folder, pool, opts, warm_preload=WARM_PRELOAD)


# --------------------------------------------------------------------------- doing it

def _record(sweep, options: dict, slots: int | None = None) -> dict:
    if slots is None:
        slots = sweep.pool.capacity()
        if sweep.options.max_parallel:
            slots = min(slots, sweep.options.max_parallel)
    return {"spec": sweep.spec.to_json(), "options": {k: v for k, v in options.items() if k != "out"},
            "cwd": os.getcwd(), "started": time.time(), "slots": max(1, slots)}


def _execute(folder, sweep, options: dict) -> int:
    echo = None if os.environ.get(DETACHED_ENV) else print
    sweep.echo = echo
    sweep.refuse_while_stopping()
    folder.write_sweep(_record(sweep, options))
    folder.event(f"sweep of {sweep.runs_phrase()} on {sweep.pool.describe()}"
                 + (f", at most {sweep.options.max_parallel} at once" if sweep.options.max_parallel else "")
                 + f"; folder {folder.root}", echo)
    if (shared := sweep.pool.shared_cores()) is not None:
        folder.event(shared, echo)
    return sweep.execute()


def _detach(folder, sweep, options: dict) -> int:
    """Start this sweep in a new session with its output in DIR/sweep.log; return once it runs."""
    if folder.holder_pid() is not None:
        raise UsageError(f"a sweep (pid {folder.holder_pid()}) is already working in {folder.root}; "
                         f"follow it with: multigpu sweep --status {folder.root}")
    folder.root.mkdir(parents=True, exist_ok=True)
    folder.write_sweep(_record(sweep, options))
    argv = [sys.executable, "-P", "-m", "multigpu", "sweep", "--resume", str(folder.root)]
    with open(folder.log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, env={**os.environ, DETACHED_ENV: "1"})
    for _ in range(100):  # until it holds the folder's lock, or has failed
        if folder.holder_pid() == proc.pid:
            break
        if proc.poll() is not None:
            from multigpu.sweep.state import log_tail

            raise UsageError(f"the sweep did not start: {log_tail(folder.log_path, 1)}")
        time.sleep(0.1)
    print(f"sweep of {sweep.runs_phrase()} goes on in the background (pid {proc.pid}); "
          f"see where it stands: multigpu sweep --status {folder.root}; its log: {folder.log_path}")
    return 0


def _on_slurm(spec, options: dict, folder, nodes: int) -> int:
    """Submit the runs that are neither done nor still on SLURM's queue as one job array."""
    from multigpu.sweep import slurm
    from multigpu.sweep import spec as specs
    from multigpu.sweep.pool import parse_per_run
    from multigpu.sweep.scheduler import Options, Sweep
    from multigpu.sweep.slurm_task import RunTask

    runs = specs.expand(spec)
    check_folder(spec, folder)
    if options.get("runs_per_gpu") is not None:
        raise UsageError("--runs-per-gpu packs runs onto this machine's GPUs; on SLURM each run is "
                         "a job of its own: leave it out, or run the sweep here without --on slurm")
    settings = slurm.SlurmSettings(
        per_run=str(options.get("devices_per_run") or "1"),
        time_s=parse_duration(options.get("time"), "--time") or slurm.DEFAULT_TIME_S,
        partition=options.get("partition"), extra=slurm.parse_slurm_args(options.get("slurm_arg")),
        max_parallel=number_option(options, "max_parallel", int, None, 1), nodes=nodes)
    parse_per_run(settings.per_run)
    slurm.check_ready()
    task = RunTask(str(folder.root.absolute()), os.getcwd(), settings.devices_arg(),
                   retries=number_option(options, "retries", int, 0, 0),
                   timeout_s=parse_duration(options.get("timeout")), nodes=settings.nodes)
    fresh = not folder.root.exists()  # a first submission that fails leaves no folder behind
    if not folder.lock():
        raise UsageError(f"a sweep (pid {folder.holder_pid()}) is already working in {folder.root}; "
                         f"follow it with: multigpu sweep --status {folder.root}")
    try:
        sweep = Sweep(spec, runs, folder, None, Options(metric=options.get("metric")))
        todo, waiting = slurm.todo(folder, runs)
        folder.write_sweep(_record(sweep, options, settings.max_parallel or len(runs)))
        if not todo:
            sweep.write_summary()
            folder.event(f"nothing to submit: {len(runs) - waiting} of {len(runs)} runs done, "
                         f"{waiting} queued or running on SLURM; summary in "
                         f"{folder.root / 'summary.md'}", print)
            return 0
        try:
            ids = slurm.submit(folder, todo, task, settings)
        except UsageError:
            if fresh:  # only what this command made: sweep.json, the lock, submitit's pickles
                shutil.rmtree(folder.root, ignore_errors=True)
            raise
        sweep.write_summary()
        what = f"{len(todo)} runs" if len(todo) > 1 else "1 run"
        folder.event(f"submitted {what} to SLURM as job array {ids[0].split('_')[0]} "
                     f"({settings.describe()}); follow it with: multigpu sweep --status "
                     f"{folder.root}", print)
        return 0
    finally:
        folder.unlock()


def _dry_run(spec, options, folder) -> int:
    from multigpu.sweep import spec as specs

    for run in specs.expand(spec):
        values = {"out": str(folder.run_dir(run.name)), "devices": "<devices>", "port": "<port>"}
        print(f"{run.name}: {' '.join(specs.argv_for(spec, run, values))}")
    return 0


def _status(root: Path) -> int:
    from multigpu.sweep import spec as specs
    from multigpu.sweep.scheduler import Options, Sweep
    from multigpu.sweep.state import SweepFolder
    from multigpu.sweep.status import render

    folder = SweepFolder(root)
    record = folder.read_sweep()
    if record is None:
        raise UsageError(f"--status {root}: no sweep there (no sweep.json); give a sweep's --out "
                         "folder, e.g. sweeps/ts")
    spec = specs.SweepSpec(**record["spec"])
    opts = Options(metric=record.get("options", {}).get("metric"))
    print(render(folder, Sweep(spec, specs.expand(spec), folder, None, opts)))
    return 0
