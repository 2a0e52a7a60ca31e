"""`multigpu test`: check a machine before training on it, through the real launcher.

    multigpu test                          every free GPU (2 CPU processes when there is none)
    multigpu test --devices 0,3            GPUs 0 and 3
    multigpu test --devices cpu:2          2 CPU processes on gloo
    multigpu test --checkpoint-dir /shared/ckpt    also check the folder your runs will save to

Starts one process per device as `multigpu run` does (the launcher's loop, the hang watchdog); each
rank checks the process group (backend, world size, ranks), all_reduce, broadcast, all_gather and
barrier with their values, a few DDP training steps after which the weights must be equal on every
rank, a checkpoint round trip through rt.save/rt.load, and bf16/fp16 autocast where the device has
it (with one device, the collectives are skipped). Rank 0 prints one table (check,
ok/FAIL/skip, detail). Exit status 0 when no check failed,
1 otherwise; every rank's log stays in --log-dir when something failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path

from multigpu.core.system import fileio
from multigpu.launcher import devices

DEFAULT_HANG_TIMEOUT = 60.0  # a check stuck in a collective is named after this long


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "test", help="check this machine: collectives, DDP steps, checkpoints, autocast",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="auto", metavar="SPEC",
                   help=f"which devices: {devices.GRAMMAR}. Default auto (cpu:2 without a GPU)")
    p.add_argument("--min-free-memory", type=float, default=2.0, metavar="GB",
                   help="a GPU with less free memory than this counts as busy (default 2)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where the checkpoint round trip writes (default: a new temporary folder)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="every rank's log (default: a temporary folder, removed when all pass)")
    p.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT, metavar="SECONDS",
                   help="stop when no rank has moved for this long "
                        f"(default {DEFAULT_HANG_TIMEOUT:g})")
    return p


def choose_devices(spec: str, min_free_memory: float) -> devices.DevicePlan:
    """The `--devices` plan, except that `auto` on a machine without a free GPU is 2 CPU
    processes, not 1: the collectives need two. The plan keeps the note saying why."""
    plan = devices.resolve_devices(spec, min_free_memory_gb=min_free_memory)
    if spec.strip().lower() == "auto" and plan.accelerator == "cpu":
        plan = dataclasses.replace(devices.resolve_devices("cpu:2"), note=plan.note)
    return plan


def main(args) -> int:
    from multigpu.launcher import launch  # imports torch only when a test is run

    for path, option in ((args.log_dir, "--log-dir"), (args.checkpoint_dir, "--checkpoint-dir")):
        if path:
            fileio.check_can_make(path, option)
    plan = choose_devices(args.devices, args.min_free_memory)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="multigpu-test-logs-")
    result = Path(log_dir) / "selftest.json"
    result.unlink(missing_ok=True)
    # what `multigpu run -m multigpu.doctor.selftest` starts: the watchdog, then the module
    cmd = launch.python_command("multigpu.launcher.rank.worker", "-m", "multigpu.doctor.selftest",
                                "--result", str(result))
    if args.checkpoint_dir:
        cmd += ["--checkpoint-dir", str(Path(args.checkpoint_dir).resolve())]
    opts = launch.LaunchOptions(log_dir=log_dir, hang_timeout=args.hang_timeout, start_timeout=120)
    code = launch.launch(cmd, plan, opts, python=False, reporting=launch.Reporting(our_worker=True))
    if not result.is_file():
        print(f"multigpu: the self-test did not finish (exit status {code}); every rank's log: "
              f"{log_dir}", file=sys.stderr)
        return code or 1
    passed = json.loads(result.read_text())["passed"]
    if passed and args.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif not passed:
        print(f"multigpu: self-test FAILED; every rank's log: {log_dir}", file=sys.stderr)
    return 0 if passed else 1
