"""`multigpu train`: the main job, on built-in models and data.

The parent process checks the arguments, picks the devices and reserves the run folder; with more
than one process it hands over to torch.distributed.run, which starts this same command once per
device. Inside a worker, only the training runs.
"""
from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Callable

from multigpu.core import checkpoint_schema as schema
from multigpu.train import configfile, provenance, timeline
from multigpu.launcher import devices
from multigpu.core import compiling, console
from multigpu.cli import strategy_checks
from multigpu.train.config import TrainConfig, add_config_arguments, config_from_args, config_to_argv
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


# flag -> (smallest allowed value, whether that value itself is allowed): every number must also
# be finite. One table, so that a new numeric flag gets its check in one place.
_LIMITS = {"epochs": (1, True), "batch_size": (1, True), "accumulate": (1, True),
           "seq_length": (1, True), "future_length": (1, True), "step_size": (1, True),
           "keep": (1, True), "image_size": (1, True), "workers": (0, True), "log_every": (1, True),
           "lr": (0, False), "weight_decay": (0, True), "gamma": (0, False),
           "clip_grad_norm": (0, False), "min_free_memory": (0, True)}


def validate(cfg: TrainConfig) -> None:
    """Cheap checks in the parent, so a mistake costs one line instead of N crashing workers."""
    from multigpu.core import loggers
    from multigpu.train.control import Cadence
    from multigpu.train.data_specs import check_spec
    from multigpu.train.folder_layout import check_root
    from multigpu.train.model_names import check_input_kind, model_input_kind

    for name, (low, inclusive) in _LIMITS.items():
        value = getattr(cfg, name)
        if value is None or value == "auto":  # optional and left out; --batch-size auto
            continue
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            flag = "--" + name.replace("_", "-")
            bound = f"at least {low}" if inclusive else f"more than {low}"
            raise UsageError(f"{flag} {value:g} must be a number {bound}, e.g. {flag} "
                             f"{_EXAMPLES.get(name, max(low, 1))}")
    Cadence.parse(cfg.checkpoint_every)
    loggers.parse(cfg.logger)
    strategy_checks.check_flags(cfg.strategy, {f for f in vars(cfg) if getattr(cfg, f) is True})
    input_kind = model_input_kind(cfg.model)  # raises on an unknown model
    check_spec(cfg.data)  # `--data ./imgs`: one line naming folder:./imgs, before any launch
    check_input_kind(cfg.data, input_kind)
    kind, _, path = cfg.data.partition(":")
    if kind == "folder" and path:
        check_root(path)  # a mistyped path: one line now, not one per worker after the launch


_EXAMPLES = {"lr": 0.001, "weight_decay": 0.01, "gamma": 0.9, "clip_grad_norm": 1.0,
             "min_free_memory": 2, "workers": 4, "batch_size": 64, "image_size": 224}


def _finished_before_the_signal(code: int, out, epochs: int) -> int:
    """A launch stopped by a stop signal (launch.stopped_by_signal: Ctrl-C, a scheduler's
    SIGTERM) while its ranks were only exiting, every epoch and the last checkpoint complete,
    finished: exit 0, saying so. A rank's own death by a signal keeps its code."""
    from multigpu.train import runfolder
    from multigpu.launcher.launch import stopped_by_signal

    if not stopped_by_signal(code) or (done := runfolder.finished_checkpoint(out, epochs)) is None:
        return code
    last, trained = done
    console.info(f"multigpu train: the run had finished before the signal ({trained} epochs "
                 f"trained, {last} complete): exit 0")
    return 0


def main(args: argparse.Namespace) -> int:
    from multigpu.train.setup_checks import refuse_stale_worker_env
    from multigpu.launcher.launch import in_worker, launch, options_from_args, python_command, stopped_by_signal
    from multigpu.train import runfolder
    from multigpu.train.folder_users import OUT_RESERVED_ENV

    cfg = config_from_args(args)
    refuse_stale_worker_env(os.environ, console.warn)  # trap 8: LOCAL_RANK left by a launch
    if in_worker():  # started by torch.distributed.run: devices and folder are decided already
        from multigpu.train.trainloop import run_training

        run_training(cfg, launch=provenance.from_env(), process_started=args.started_at)
        return 0
    timeline.mark_command_start(getattr(args, "started_at", time.time()))  # workers inherit it

    validate(cfg)
    plan = _plan_devices(cfg)
    # at once, before the slow torch import: the GPUs look free only until someone else starts
    devices.lease(plan, f"multigpu train {cfg.out or f'--model {cfg.model} --data {cfg.data}'}",
                  cfg.min_free_memory)
    opts = options_from_args(args)
    check_resume(cfg)
    out, clean_up = _claim_folder(cfg, opts)
    cfg.out = str(out)
    os.environ[OUT_RESERVED_ENV] = str(out.resolve())
    typed = getattr(args, "command_line", None) or ["multigpu", "train", *config_to_argv(cfg)]
    launch_facts = provenance.launch_facts(typed)
    os.environ.update(provenance.to_env(launch_facts))  # workers are started with other argv
    console.info(f"multigpu train: {plan.describe()}")
    if plan.nproc > 1 or opts.nnodes != "1":
        opts.log_dir = opts.log_dir or str(out / runfolder.LOGS)
        argv = python_command("multigpu", *(["--debug"] if args.debug else []), "train",
                              *config_to_argv(cfg))
        try:  # bad input the workers found is said in one line (on_usage_error), and so is ours
            code = launch(argv, plan, opts, python=False, on_usage_error=clean_up,
                          next_step=lambda: _resume_line(out, typed))
        except (UsageError, KeyboardInterrupt):
            clean_up()
            raise
        if stopped_by_signal(code) or (code and not _any_output(out / runfolder.LOGS)):
            clean_up()  # (nothing trained: only then) a start-up stopped, or failed unheard
        return _finished_before_the_signal(code, out, cfg.epochs)
    # torch only now, in this process alone: every mistake found above costs one line and no
    # torch import, and a launch of several processes starts them without the training modules
    from multigpu.train.trainloop import run_training

    try:
        run_training(cfg, device_ids=list(plan.gpu_ids) or None, accelerator=plan.accelerator,
                     launch=launch_facts, process_started=args.started_at)
    except (UsageError, KeyboardInterrupt):
        clean_up()
        raise
    return 0


def _resume_line(out: Path, typed: list[str]) -> str | None:
    """After a launch the ranks could not end themselves (a rank killed, a second Ctrl-C): the
    command that goes on from the newest complete checkpoint (all its files there, whole: no
    checksum of a large file holds the exit), when there is one."""
    import shlex

    from multigpu.train.checkpoint_store import CheckpointStore

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


def _claim_folder(cfg: TrainConfig, opts) -> tuple[Path, Callable[[], None]]:
    """The run folder, claimed, and what removes it again when the run stops on bad input, or
    is stopped by a signal, before its first epoch: the outermost folder of --out that is new, or the new folder under runs/
    (runs/ may be there already); of an empty folder the user made, only what the run wrote in
    it. Never a run that trained, nor on several nodes (node 0 owns the shared folder)."""
    from multigpu.train import runfolder

    target = runfolder.out_for(cfg)  # None: a new folder under runs/
    made = _first_missing(Path(target) if target else Path("runs"))
    emptied = target is not None and Path(target).is_dir() and not any(Path(target).iterdir())
    if opts.nnodes != "1" and opts.node_rank not in (None, 0):
        # Node 0 claims the folder (on a shared filesystem a second claim would fail); global
        # rank 0, wherever it runs, tells every rank which folder that is.
        out = Path(cfg.out) if cfg.out else runfolder.default_out(cfg.model, cfg.data)
    else:
        out = runfolder.reserve_out(cfg, nodes_log=opts.nnodes != "1")
    made = made or (out if target is None else None)

    def clean_up() -> None:
        if (opts.nnodes == "1" and (made is not None or emptied)
                and runfolder.nothing_trained(out, logs=True)):
            runfolder.remove_untrained(out, up_to=made or out, keep=made is None)
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


def check_resume(cfg: TrainConfig) -> None:
    """A --resume that cannot be used fails here, before a run folder is made (its checkpoint is
    read twice: here and on rank 0). Skipped when --out already has checkpoints of its own: the
    run goes on from those."""
    if not cfg.resume:  # (before the imports: they load torch and the checkpoint code)
        return
    from multigpu.train.checkpoint_store import CheckpointStore
    from multigpu.train.runfolder import CONFIG
    from multigpu.train.runstate import load_source

    if _nothing_trained_in(cfg):
        return
    if cfg.out and CheckpointStore(schema.checkpoints_folder(Path(cfg.out))).has_checkpoints():
        # the run goes on from --out's own checkpoints, whose model its config.json names
        path = Path(cfg.out)
        saved = _json_field(path / CONFIG, "model")
    else:
        state, path = load_source(cfg.resume)
        saved = (state.get(schema.CONFIG) or {}).get("model")
    if saved and saved != cfg.model:  # its weights would not fit: refuse before any change
        raise UsageError(f"--resume {path}: its checkpoints are of --model {saved}, and this run "
                         f"asks for --model {cfg.model}; give --model {saved}, or another "
                         "checkpoint")


def _nothing_trained_in(cfg: TrainConfig) -> bool:
    """--resume of a run folder in which nothing was trained (a launch killed or stopped during
    start-up): the run starts from scratch in it, said in one line; whether that is the case."""
    from multigpu.train import runfolder

    source = Path(cfg.resume)
    if not (source.is_dir() and runfolder.untrained_run_folder(source)
            and (not cfg.out or Path(cfg.out).resolve() == source.resolve())):
        return False
    console.info(f"multigpu train: --resume {cfg.resume}: nothing was trained there yet (no "
                 "checkpoint); starting from scratch in it")
    cfg.out, cfg.resume = cfg.out or cfg.resume, None
    return True


def _json_field(path: Path, key: str):
    import json

    try:
        return json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _plan_devices(cfg: TrainConfig):
    from multigpu.launcher.devices import resolve_devices
    from multigpu.core.strategies import registry

    strategy = registry.info(cfg.strategy)
    plan = resolve_devices(cfg.devices, one_process=strategy.one_process,
                           min_free_memory_gb=cfg.min_free_memory)
    strategy_checks.check_device_count(cfg.strategy, cfg.devices, plan.accelerator,
                                       len(plan.gpu_ids), plan.nproc)
    compiling.check(cfg.compile, plan.accelerator, cfg.strategy, cfg.accumulate)
    if cfg.compile:  # before torch._dynamo is imported (DDP does), which sets torch's own default
        compiling.use_persistent_cache()
    strategy_checks.check_accelerator(cfg.strategy, plan.accelerator,
                                      auto_batch=cfg.batch_size == "auto")
    if cfg.fsdp_cpu_offload and plan.accelerator != "cuda":
        from multigpu.core.strategies.fsdp import OFFLOAD_NEEDS_GPUS
        raise UsageError(OFFLOAD_NEEDS_GPUS)
    if cfg.decode == "gpu" and plan.accelerator != "cuda" and cfg.data.startswith("folder:"):
        raise UsageError(f"--decode gpu decodes JPEGs on GPUs, and this run is on {plan.accelerator}: "
                         "use --decode cpu (the loader workers decode) or auto")
    return plan
