"""`multigpu run`: start any script once per device, with torchrun's environment.

    multigpu run train.py --lr 0.1                   every free GPU (or 1 CPU process)
    multigpu run --devices 2 train.py                2 free GPUs
    multigpu run --devices 0,3 -m mypkg.train        GPUs 0 and 3, a module
    multigpu run --devices cpu:4 train.py            4 CPU processes on gloo
    multigpu run --auto train.py                     a one-GPU script, unmodified, data-parallel
    # two machines, the same command on each (node 0 first):
    multigpu run --nnodes 2 --node-rank 0 --master-addr node01 --master-port 29500 train.py
    multigpu run --nnodes 2 --node-rank 1 --master-addr node01 --master-port 29500 train.py

Everything after the script (or module) goes to it untouched. Each process gets torchrun's
environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
Scripts written for the old `python -m torch.distributed.launch` parse `--local_rank` themselves:
with --local-rank-arg auto (the default) we read the script's source and pass `--local_rank=N`
or `--local-rank=N` when it mentions one of them.

--auto runs an unmodified one-device training script data-parallel: in each process its
shuffled DataLoaders, and the streams (IterableDatasets) it trains on, are split (the script's
batch_size is the global batch; --auto-batch per-gpu keeps it per process), the modules its
optimizers train average their gradients as DDP does, `.cuda()` means the process's own GPU and
torch.save writes once. Loaders without shuffle (evaluation) stay whole on every process. A
script that forms its own process group or a batch_sampler of its own is refused in one line.

Without --auto, a script's source is read for its traps before any process starts (check_source);
one that trains but forms no process group, started N > 1 times, runs N independent full copies:
said in one line, with --auto as the fix, and started all the same.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from multigpu.launcher import devices, launch
from multigpu.auto import BATCH_MODES, FIND_UNUSED_ENV
from multigpu.core.system import fileio
from multigpu.core.errors import UsageError
from multigpu.launcher.scripts import local_rank_args, module_source, script_command

def register(subparsers) -> argparse.ArgumentParser:
    # no abbreviations (cli._Parser): the script's own options follow its name
    p = subparsers.add_parser(
        "run", help="run a script once per GPU (or CPU process), on one machine or several",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="auto", metavar="SPEC",
                   help=f"which devices: {devices.GRAMMAR}. Default auto")
    p.add_argument("--min-free-memory", type=float, default=2.0, metavar="GB",
                   help="a GPU with less free memory than this counts as busy (default 2; "
                        "0 = use busy GPUs too)")
    p.add_argument("--local-rank-arg", choices=["auto", "none", "underscore", "dash"],
                   default="auto",
                   help="pass --local_rank=N (underscore) or --local-rank=N (dash) to the script, "
                        "as torch.distributed.launch did; auto: when its source mentions one")
    p.add_argument("--auto", action="store_true",
                   help="run an unmodified one-device script data-parallel: shuffled DataLoaders "
                        "split, gradients averaged, .cuda() = the process's own GPU, torch.save "
                        "once (see above)")
    p.add_argument("--auto-batch", choices=BATCH_MODES, default=None,
                   help="with --auto: the script's DataLoader batch_size is the global batch "
                        "(global, the default: each of N processes takes batch_size/N) or each "
                        "process's (per-gpu)")
    p.add_argument("--auto-unused", action="store_true",
                   help="with --auto: for a model with parameters some steps do not use (a head "
                        "or branch the loss leaves out): DDP looks for them each step "
                        "(find_unused_parameters; slower)")
    launch.add_launch_arguments(p)
    p.add_argument("-m", "--module", action="store_true",
                   help="TARGET is a module, run as python -m TARGET")
    p.add_argument("target", metavar="script.py | -m module",
                   help="the script (or, with -m, the module) to run on every device")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                   help="arguments for the script, passed untouched")
    return p


def main(args) -> int:
    target, script_args = args.target, list(args.script_args)
    if target == "--" and script_args:  # `multigpu run [options] -- script.py ...`
        target, script_args = script_args[0], script_args[1:]
    if args.module:
        source = module_source(target)
        cmd, python = ["-m", target], True
    else:
        source = Path(target)
        if not source.is_file():
            raise UsageError(f"script {target!r} not found (in {os.getcwd()}); give the path of a "
                             "Python script, or -m package.module to run a module")
        cmd, python = script_command(source)
    if args.auto:
        cmd = auto_command(target, cmd, python, args.auto_batch)
        if args.auto_unused:
            os.environ[FIND_UNUSED_ENV] = "1"  # every process of the launch
    elif args.auto_batch is not None or args.auto_unused:
        flag = f"--auto-batch {args.auto_batch}" if args.auto_batch else "--auto-unused"
        raise UsageError(f"{flag} is a choice of --auto: add --auto, or drop {flag.split()[0]}")
    elif python:  # through multigpu.launcher.rank.worker: the hang watchdog, then the script as python runs it
        cmd = launch.python_command("multigpu.launcher.rank.worker", *cmd,
                                    *local_rank_args(args.local_rank_arg, source))
    if args.log_dir:
        fileio.check_can_make(args.log_dir, "--log-dir")
    plan = devices.resolve_devices(args.devices, min_free_memory_gb=args.min_free_memory)
    if plan.crowded():
        print(f"multigpu: warning: {plan.crowded()}", file=sys.stderr)
    if source is not None:
        refuse_unparsable(source)  # no process started to die on it
    if source is not None and not args.auto:  # its checks are for a script that is distributed
        check_source(source, plan, args.master_port)
    devices.lease(plan, f"multigpu run {target}", args.min_free_memory)
    opts = launch.options_from_args(args)
    return launch.launch(cmd + script_args, plan, opts, python=False,
                         reporting=launch.Reporting(our_worker=python))


def auto_command(target: str, cmd: list[str], python: bool, batch: str | None) -> list[str]:
    """The worker command of --auto (multigpu.auto.worker, started by name: the launcher does
    not import it). No --local_rank argument: a one-device script does not parse one."""
    if not python:
        raise UsageError(f"--auto makes a Python training script data-parallel, and {target} is "
                         "not one (not .py, no python shebang); run it without --auto")
    return launch.python_command("multigpu.auto.worker", batch or BATCH_MODES[0], *cmd)


def refuse_unparsable(source: Path) -> None:
    """A Python script that Python cannot parse stops here, in one line, not in N processes."""
    from multigpu.doctor.script_checks import syntax_error

    try:
        data = source.read_bytes()
    except OSError:
        return  # a module's source, or one that cannot be read: the launch says what it finds
    if source.suffix == ".py" or data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
        found = syntax_error(source, data)
        if found is not None:
            raise UsageError(f"{found[0]}: Python cannot parse it ({found[1]}): fix this line (a "
                             "Python 2 script needs porting); no process was started")


def check_source(source: Path, plan, master_port: int | None) -> None:
    """The traps the script's source shows, said once before any process starts; one that is
    certain to hang until --hang-timeout (it sets MASTER_PORT itself) refuses the launch."""
    from multigpu.core.findings import warn_all
    from multigpu.doctor.script_checks import script_findings

    try:
        found = script_findings(source, nproc=plan.nproc, gpus=plan.accelerator == "cuda",
                                master_port=master_port)
    except Exception as exc:  # noqa: BLE001 - a bug in a check must never block a launch
        found = []
        print(f"multigpu: note: the script checks failed ({type(exc).__name__}: {exc}); "
              "starting it anyway", file=sys.stderr)
    hang = next((f for f in found if f.level == "fail" and f.check == "launch env"), None)
    if hang is not None:
        raise UsageError(f"{hang.where}: {hang.message}")
    warn_all(found)
