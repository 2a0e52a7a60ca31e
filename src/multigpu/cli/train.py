"""`multigpu train`: the main job, on built-in models and data.

The parent process checks the arguments, picks the devices and reserves the run folder; with more
than one process it hands over to torch.distributed.run, which starts this same command once per
device. Inside a worker, only the training runs.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from collections.abc import Callable

from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.train.settings import configfile
from multigpu.train.data import data_specs
from multigpu.train import global_batch
from multigpu.train.rundir import provenance, timeline
from multigpu.launcher import devices
from multigpu.core import compiling, console
from multigpu.core.system import fileio
from multigpu.cli import strategy_checks
from multigpu.cli.resume_checks import check_resume
from multigpu.train.settings.config import TrainConfig, add_config_arguments, config_from_args, config_to_argv
from multigpu.core.errors import UsageError

EXAMPLES = """\
examples:
  multigpu train --model cnn --data digits                       # every free GPU (or 1 CPU process)
  multigpu train --model resnet18 --data folder:./imgs --devices 1          # one GPU
  multigpu train --model resnet50 --data synthetic:20000 --devices 4        # 4 GPUs, DDP
  multigpu train --model vgg16 --data folder:./imgs --devices 0,3           # GPUs 0 and 3
  multigpu train --model mlp --data digits --devices cpu:2                  # 2 CPU processes (gloo)
  multigpu train --model mlp --data digits --devices 0,1 --strategy dp      # nn.DataParallel
  multigpu train --model lstm --data timeseries:co2 --seq-length 40 --future-length 4   # embedded series
  multigpu train --config run.yaml --epochs 3              # settings from a file, one changed
  multigpu train --config runs/X/config.json               # repeat run X, in a new folder
"""


def register(subparsers) -> argparse.ArgumentParser:
    from multigpu.launcher.launch import add_launch_arguments

    p = subparsers.add_parser(
        "train", help="train a built-in model on built-in or folder data",
        description="Train a built-in model; writes config.json, metrics.jsonl and checkpoints/ "
                    "into a new run folder.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p)
    p.add_argument("--config", metavar="FILE",
                   help="read settings from a YAML or JSON file (keys are these flags, e.g. "
                        "batch_size: 128); flags given here win; a run's config.json repeats it")
    add_launch_arguments(p)
    configfile.read_config_first(p, on_note=console.info)
    return p


def validate(cfg: TrainConfig) -> None:
    """What the parent checks beyond the values themselves (each component refused those when
    `cfg` was made): a folder that is not there costs one line instead of N crashing workers."""
    from multigpu.train.data.folder_layout import check_folder
    from multigpu.train.data.shard_layout import check_shards
    from multigpu.train.rundir.step_profile import window_from_env

    kind, _, path = cfg.input.data.partition(":")
    if kind == "folder" and path:
        check_folder(path)  # a mistyped path, an empty class: one line now, not after the launch
    if kind == "shards" and path:
        check_shards(path)  # the same, and each shard's index built here once, not by every rank
    window_from_env()  # MULTIGPU_PROFILE_STEPS, if set


def _finished_before_the_signal(code: int, out, epochs: int) -> int:
    """A launch stopped by a stop signal (stop_reason.stopped_by_signal: Ctrl-C, a scheduler's
    SIGTERM) while its ranks were only exiting, every epoch and the last checkpoint complete,
    finished: exit 0, saying so. A rank's own death by a signal keeps its code."""
    from multigpu.train.rundir import runfolder
    from multigpu.launcher.rank.stop_reason import stopped_by_signal

    if not stopped_by_signal(code) or (done := runfolder.finished_checkpoint(out, epochs)) is None:
        return code
    last, trained = done
    console.info(f"multigpu train: the run had finished before the signal ({trained} epochs "
                 f"trained, {last} complete): exit 0")
    return 0


def main(args: argparse.Namespace) -> int:
    from multigpu.train.checks.setup_checks import refuse_stale_worker_env
    from multigpu.launcher.launch import (Reporting, check_min_devices, in_worker, launch,
                                          options_from_args)
    from multigpu.launcher.rank.stop_reason import stopped_by_signal
    from multigpu.train.rundir import runfolder
    from multigpu.train.rundir.folder_users import OUT_RESERVED_ENV

    refuse_stale_worker_env(os.environ, console.warn)  # trap 8: LOCAL_RANK left by a launch
    cfg = config_from_args(args)  # each component refuses a value it cannot take
    if in_worker():  # started by torch.distributed.run: devices and folder are decided already
        from multigpu.train.trainloop import run_training

        run_training(cfg, launch=provenance.from_env(), process_started=args.started_at)
        return 0
    timeline.mark_command_start(getattr(args, "started_at", time.time()))  # workers inherit it

    validate(cfg)
    plan = _plan_devices(cfg)
    # at once, before the slow torch import: the GPUs look free only until someone else starts
    devices.lease(plan, f"multigpu train {cfg.out or f'--model {cfg.model} --data {cfg.input.data}'}",
                  cfg.min_free_memory)
    opts = options_from_args(args)
    check_min_devices(opts, plan)
    if opts.nnodes == "1":
        check_data_fits(cfg, plan)
        global_batch.check_before_launch(cfg, _devices_of(cfg, plan))
    cfg = check_resume(cfg)
    fileio.check_can_make(runfolder.out_for(cfg) or "runs", "--out")
    if opts.log_dir:
        fileio.check_can_make(opts.log_dir, "--log-dir")
    out, clean_up = _claim_folder(cfg, opts)
    cfg = replace(cfg, out=str(out))
    os.environ[OUT_RESERVED_ENV] = str(out.resolve())
    typed = getattr(args, "command_line", None) or ["multigpu", "train", *config_to_argv(cfg)]
    launch_facts = provenance.launch_facts(typed)
    os.environ.update(provenance.to_env(launch_facts))  # workers are started with other argv
    launched = plan.nproc > 1 or opts.nnodes != "1" or opts.max_restarts > 0  # a restart needs one
    if not launched:  # the launcher's header says the devices, with where each rank's output goes
        console.info(f"multigpu train: {plan.describe()}")
    if plan.crowded():
        console.warn(plan.crowded())
    if launched:
        opts.log_dir = opts.log_dir or str(out / runfolder.LOGS)
        # bad input the workers found is said in one line (on_usage_error), and so is ours
        with _untrained_removed(clean_up, out):
            code = launch(_worker_argv(cfg, args.debug), plan, opts, python=False, reporting=Reporting(
                on_usage_error=clean_up, next_step=lambda: _resume_line(out, typed),
                ranks_say_their_stop=True), reshape=global_batch.on_fewer_devices(
                    cfg, lambda changed: _worker_argv(changed, args.debug)))
        if stopped_by_signal(code) or (code and not _any_output(out / runfolder.LOGS)):
            with _deaf_to_ctrl_c():  # (nothing trained: only then) a start-up stopped, or failed unheard
                _say_removed(clean_up(), out)
        return _finished_before_the_signal(code, out, cfg.epochs)
    # torch only now, in this process alone: every mistake found above costs one line and no
    # torch import, and a launch of several processes starts them without the training modules
    from multigpu.train.trainloop import run_training

    with _untrained_removed(clean_up, out):
        run_training(cfg, device_ids=list(plan.gpu_ids) or None, accelerator=plan.accelerator,
                     launch=launch_facts, process_started=args.started_at)
    return 0


def _worker_argv(cfg: TrainConfig, debug: bool) -> list[str]:
    from multigpu.launcher.launch import python_command

    return python_command("multigpu", *(["--debug"] if debug else []), "train", *config_to_argv(cfg))


@contextlib.contextmanager
def _untrained_removed(clean_up, out: Path):
    """Bad input (said in one line) or Ctrl-C inside: the run folder goes if nothing was trained
    (clean_up), and after a Ctrl-C the user is told so."""
    try:
        yield
    except UsageError:
        clean_up()
        raise
    except KeyboardInterrupt:
        with _deaf_to_ctrl_c():
            _say_removed(clean_up(), out)
        raise


@contextlib.contextmanager
def _deaf_to_ctrl_c():
    """The run is ending on a stop already: a second Ctrl-C (0.2 s after the first, as a double
    press sends it) would cut its tidying short, leaving a half-removed folder that blocked both
    the same command and --resume. Ignored (and discarded) while it tidies."""
    try:
        before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to guard
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _say_removed(removed: str | None, out: Path) -> None:
    """After a stop (or a failure) before anything was trained: what of the run folder went."""
    if removed == "folder":
        console.info(f"multigpu train: nothing was trained: {out} removed")
    elif removed == "contents":
        console.info(f"multigpu train: nothing was trained: what the run wrote in {out} removed; "
                     f"{out} itself, made before the run, kept")


def _resume_line(out: Path, typed: list[str]) -> str | None:
    """After a launch the ranks could not end themselves (a rank killed, a second Ctrl-C): the
    command that goes on from the newest complete checkpoint (all its files there, whole: no
    checksum of a large file holds the exit), when there is one."""
    import shlex

    from multigpu.train.checkpoints.checkpoint_store import CheckpointStore

    try:
        complete = CheckpointStore(schema.checkpoints_folder(out)).newest_complete()
    except UsageError:  # a manifest that cannot be read: nothing to promise
        return None
    if complete is None:
        return None
    argv, skip = [], False
    for arg in typed:  # the command as typed, its --resume (if any) replaced
        if skip or arg == "--resume" or arg.startswith("--resume="):
            skip = arg == "--resume"
            continue
        argv.append(arg)
    return (f"checkpoint {complete} is complete; to go on from it, run: "
            f"{shlex.join([*argv, '--resume', str(out)])}")


def _claim_folder(cfg: TrainConfig, opts) -> tuple[Path, Callable[[], str | None]]:
    """The run folder, claimed, and what removes it again when the run stops on bad input, or
    is stopped by a signal, before its first epoch: the outermost folder of --out that is new, or
    the new folder under runs/ (runs/ may be there already); of an empty folder the user made, only
    what the run wrote in it. Never a run that trained, nor on several nodes (node 0 owns the shared
    folder). The remover returns "folder", "contents" (the user's folder kept) or None (nothing
    removed)."""
    from multigpu.train.rundir import runfolder

    target = runfolder.out_for(cfg)  # None: a new folder under runs/
    made = _first_missing(Path(target) if target else Path("runs"))
    emptied = target is not None and Path(target).is_dir() and not any(Path(target).iterdir())
    if opts.nnodes != "1" and opts.node_rank not in (None, 0):
        # Node 0 claims the folder (on a shared filesystem a second claim would fail); global
        # rank 0, wherever it runs, tells every rank which folder that is.
        out = Path(cfg.out) if cfg.out else runfolder.default_out(cfg.model, cfg.input.data)
    else:
        out = runfolder.reserve_out(cfg, nodes_log=opts.nnodes != "1")
    made = made or (out if target is None else None)

    def clean_up() -> str | None:
        if (opts.nnodes == "1" and (made is not None or emptied)
                and runfolder.nothing_trained(out, logs=True)):
            runfolder.remove_untrained(out, up_to=made or out, keep=made is None)
            return "contents" if made is None else "folder"
        return None
    return out, clean_up


def _any_output(logs: Path) -> bool:
    """Whether any rank wrote a line into the launch's logs (a failure report points at them)."""
    return logs.is_dir() and any(p.is_file() and p.stat().st_size for p in logs.rglob("*"))


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` (itself included) that does not exist yet, or None."""
    missing = None
    for p in [path.absolute(), *path.absolute().parents]:
        if p.exists():
            return missing
        missing = p
    return missing


def check_data_fits(cfg: TrainConfig, plan) -> None:
    """Fewer samples than one step's devices, where the data's size is known without reading it
    (synthetic:N): the ranks' one line, before they start. torch only here: the launcher brings
    it in while the ranks start (launcher/local_loop.py), not before."""
    kind, _, count = cfg.input.data.partition(":")
    if kind != "synthetic" or not count.isdigit() or int(count) < 1 or \
            not isinstance(cfg.input.batch_size, int):
        return  # synthetic:0 is the data spec's own error
    from multigpu.core.loading.data import ShardedBatchSampler

    ShardedBatchSampler(int(count), cfg.input.batch_size, num_ranks=plan.nproc,
                        devices_per_rank=_devices_of(cfg, plan) // plan.nproc)


def _devices_of(cfg: TrainConfig, plan) -> int:
    """The devices sharing each step: one per process, or a DataParallel process's GPUs."""
    dp = plan.nproc == 1 and len(plan.gpu_ids) > 1 and cfg.parallel.strategy == "dp"
    return len(plan.gpu_ids) if dp else plan.nproc


def _plan_devices(cfg: TrainConfig):
    from multigpu.launcher.devices import resolve_devices
    from multigpu.core.strategies import registry

    strategy = registry.info(cfg.parallel.strategy)
    plan = resolve_devices(cfg.devices, one_process=strategy.one_process,
                           min_free_memory_gb=cfg.min_free_memory)
    strategy_checks.check_device_count(cfg.parallel.strategy, cfg.devices, plan.accelerator,
                                       len(plan.gpu_ids), plan.nproc)
    compiling.check(cfg.compile, plan.accelerator, cfg.parallel.strategy, cfg.optim.accumulate)
    if cfg.compile:  # before torch._dynamo is imported (DDP does), which sets torch's own default
        compiling.use_persistent_cache()
    strategy_checks.check_accelerator(cfg.parallel.strategy, plan.accelerator,
                                      auto_batch=cfg.input.batch_size == "auto")
    if cfg.parallel.fsdp_cpu_offload and plan.accelerator != "cuda":
        from multigpu.core.strategies.fsdp import OFFLOAD_NEEDS_GPUS
        raise UsageError(OFFLOAD_NEEDS_GPUS)
    if (cfg.input.decode == "gpu" and plan.accelerator != "cuda"
            and data_specs.is_images(cfg.input.data)):
        raise UsageError(f"--decode gpu decodes JPEGs on GPUs, and this run is on {plan.accelerator}: "
                         "use --decode cpu (the loader workers decode) or auto")
    return plan
