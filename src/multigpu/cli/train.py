"""`multigpu train`: the main job, on built-in models and data.

The parent process checks the arguments, picks the devices and reserves the run folder; with more
than one process it hands over to torch.distributed.run, which starts this same command once per
device. Inside a worker, only the training runs.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from multigpu import compiling, console
from multigpu.config import TrainConfig, add_config_arguments, config_from_args, config_to_argv
from multigpu.errors import UsageError

EXAMPLES = """\
examples:
  multigpu train --model cnn --data digits                       # every free GPU (or 1 CPU process)
  multigpu train --model resnet18 --data folder:./imgs --devices 1          # one GPU
  multigpu train --model resnet50 --data synthetic:20000 --devices 4        # 4 GPUs, DDP
  multigpu train --model vgg16 --data folder:./imgs --devices 0,3           # GPUs 0 and 3
  multigpu train --model mlp --data digits --devices cpu:2                  # 2 CPU processes (gloo)
  multigpu train --model mlp --data digits --devices 0,1 --strategy dp      # nn.DataParallel
"""


def register(subparsers) -> argparse.ArgumentParser:
    from multigpu.launch import add_launch_arguments

    p = subparsers.add_parser(
        "train", help="train a built-in model on built-in or folder data",
        description="Train a built-in model; writes config.json, metrics.jsonl and checkpoints/ "
                    "into a new run folder.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p)
    add_launch_arguments(p)
    return p


def validate(cfg: TrainConfig) -> None:
    """Cheap checks in the parent, so a mistake costs one line instead of N crashing workers."""
    from multigpu.control import Cadence
    from multigpu.models import model_input_kind

    for name in ("epochs", "batch_size", "accumulate", "seq_length", "future_length"):
        value = getattr(cfg, name)
        if value < 1:
            raise UsageError(f"--{name.replace('_', '-')} {value} must be at least 1")
    if cfg.lr is not None and cfg.lr <= 0:
        raise UsageError(f"--lr {cfg.lr} must be positive")
    if cfg.image_size is not None and cfg.image_size < 1:
        raise UsageError(f"--image-size {cfg.image_size} must be positive")
    if cfg.keep < 1:
        raise UsageError(f"--keep {cfg.keep} must be at least 1 (the newest checkpoint is always kept)")
    Cadence.parse(cfg.checkpoint_every)
    model_input_kind(cfg.model)  # raises on an unknown model


def main(args: argparse.Namespace) -> int:
    from multigpu.launch import in_worker, launch, options_from_args, python_command
    from multigpu import runfolder
    from multigpu.runfolder import OUT_RESERVED_ENV, only_claimed
    from multigpu.training import reserve_out
    from multigpu.trainloop import run_training

    cfg = config_from_args(args)
    if in_worker():  # started by torch.distributed.run: devices and folder are decided already
        run_training(cfg)
        return 0

    validate(cfg)
    plan = _plan_devices(cfg)
    opts = options_from_args(args)
    made = not (cfg.out and Path(cfg.out).exists())  # a folder we make, we may remove
    if opts.nnodes != "1" and opts.node_rank not in (None, 0):
        # Node 0 claims the folder (on a shared filesystem a second claim would fail); global
        # rank 0, wherever it runs, tells every rank which folder that is.
        out = Path(cfg.out) if cfg.out else runfolder.default_out(cfg.model, cfg.data)
    else:
        out = reserve_out(cfg)
    cfg.out = str(out)
    os.environ[OUT_RESERVED_ENV] = str(out.resolve())
    console.info(f"multigpu train: {plan.describe()}")
    if plan.nproc > 1 or opts.nnodes != "1":
        opts.log_dir = opts.log_dir or str(out / "logs")
        argv = python_command("multigpu", *(["--debug"] if args.debug else []), "train",
                              *config_to_argv(cfg))
        return launch(argv, plan, opts, python=False)
    try:
        run_training(cfg, device_ids=list(plan.gpu_ids) or None, accelerator=plan.accelerator)
    except UsageError:
        if made and only_claimed(out):  # refused before writing anything: leave no folder behind
            (out / "config.json").unlink()
            out.rmdir()
        raise
    return 0


def _plan_devices(cfg: TrainConfig):
    from multigpu.devices import resolve_devices

    one_process = cfg.strategy in ("dp", "single")
    plan = resolve_devices(cfg.devices, one_process=one_process,
                           min_free_memory_gb=cfg.min_free_memory)
    if cfg.strategy == "single" and len(plan.gpu_ids) > 1:
        raise UsageError(f"--strategy single uses one device, but --devices {cfg.devices} gives "
                         f"{len(plan.gpu_ids)}; pass --devices 1 (or one id like 2,), or use "
                         "--strategy ddp")
    if cfg.strategy == "single" and plan.accelerator == "cpu" and plan.nproc > 1:
        raise UsageError(f"--strategy single runs one process, but --devices {cfg.devices} asks "
                         "for several; use --devices cpu:1 or --strategy ddp")
    compiling.check(cfg.compile, plan.accelerator, cfg.strategy, cfg.accumulate)
    if cfg.strategy == "dp" and plan.accelerator != "cuda":
        raise UsageError("--strategy dp (nn.DataParallel) needs GPUs; on CPU use --strategy ddp "
                         "with --devices cpu:N")
    return plan
