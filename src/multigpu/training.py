"""The main job behind `multigpu train`: built-in model + data spec -> a run folder.

Runs in every worker process (or in the one process). It reads only the launcher's environment;
choosing devices and starting processes is the CLI's business (multigpu.cli.train).

Run folder:
    config.json              the resolved settings
    metrics.jsonl            one JSON object per epoch
    checkpoints/last.pt      after every epoch
    checkpoints/best.pt      the epoch with the best validation accuracy (or loss, for regression)
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from multigpu import compiling, console
from multigpu.config import TrainConfig
from multigpu.datasets import load_data
from multigpu.distributed import destroy_distributed
from multigpu.engine import StepSettings, evaluate, train_epoch
from multigpu.errors import UsageError
from multigpu.models import build_model, default_image_size, is_convnet, model_input_kind
from multigpu.runtime import Runtime, setup
from multigpu.strategies import DDPOptions

OUT_RESERVED_ENV = "MULTIGPU_OUT_RESERVED"  # set by the CLI for the workers it launches
IN_MEMORY_DATA = ("digits", "timeseries:")
MAX_WORKERS = 16      # DataLoader workers per rank, at most
PREFETCH_FACTOR = 4   # batches each worker keeps ready


# --- run folder ------------------------------------------------------------------------------------

def default_out(cfg: TrainConfig) -> Path:
    data = cfg.data.split(":", 1)[0]
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.model.replace(':', '-')}-{data}"


def resume_checkpoint(cfg: TrainConfig, out: Path | None = None) -> Path | None:
    """The checkpoint to continue from: --resume, or after torchrun restarted the workers
    (--max-restarts), the run's own last.pt."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if restarted and not cfg.resume and out is not None:
        last = out / "checkpoints" / "last.pt"
        return last if last.is_file() else None
    if not cfg.resume:
        return None
    path = Path(cfg.resume)
    if path.is_dir():
        path = path / "checkpoints" / "last.pt"
    if not path.is_file():
        raise UsageError(f"--resume {cfg.resume}: no checkpoint there (expected a .pt file or a run "
                         "folder with checkpoints/last.pt)")
    return path


def reserve_out(cfg: TrainConfig) -> Path:
    """The run folder, created empty; an existing non-empty folder is never reused, except the
    run that --resume continues."""
    ckpt = resume_checkpoint(cfg)
    if ckpt is not None and not cfg.out:
        return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    out = Path(cfg.out) if cfg.out else default_out(cfg)
    if os.environ.get(OUT_RESERVED_ENV) == str(out.resolve()):
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} already exists and is not empty; multigpu never overwrites "
                         "a run: choose another --out, or leave it out for a new timestamped folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def atomic_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


# --- building blocks ------------------------------------------------------------------------------

def ddp_options(cfg: TrainConfig) -> DDPOptions:
    """The DDP settings of `multigpu train` (and of bench's multigpu-ddp). Buffers are not copied
    from rank 0 at every forward: the training forward of BatchNorm does not read its running
    statistics, and run_training copies rank 0's to every rank before each evaluation instead.
    On 2x H200, ResNet-50 bf16, that made the step 4-15 % faster at batch 32-128 in two runs
    (benchmarks/NOTES.md, runs 9 and 10)."""
    return DDPOptions(find_unused_parameters=cfg.find_unused_parameters, broadcast_buffers=False)


def compile_prepared(cfg: TrainConfig, rt: Runtime, model: nn.Module) -> nn.Module:
    """The prepared model, compiled in --compile's mode (unchanged without it), once the run's
    devices, strategy and accumulation are known to allow that mode."""
    compiling.check(cfg.compile, rt.device.type, rt.strategy.name, cfg.accumulate)
    return compiling.compile_model(model, cfg.compile)


def make_optimizer(cfg: TrainConfig, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    lr = cfg.lr if cfg.lr is not None else (0.05 if cfg.optimizer == "sgd" else 1e-3)
    # Fused kernels on GPUs: one launch for all parameters instead of several per tensor.
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=cfg.weight_decay, **fast)
    cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, weight_decay=cfg.weight_decay, **fast)


def make_scheduler(cfg: TrainConfig, optimizer):
    if cfg.scheduler == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)
    if cfg.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(cfg.epochs, 1))
    return None


def loader_workers(cfg: TrainConfig, rt: Runtime) -> int:
    if cfg.workers is not None:
        return cfg.workers
    if cfg.data.startswith(IN_MEMORY_DATA):
        return 0  # tensors already in memory: worker processes would only add IPC
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores // max(rt.env.local_world_size, 1) - 1))


def make_loader(dataset, batch_size: int, shuffle: bool, workers: int,
                drop_last: bool = False) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=workers,
                      drop_last=drop_last,
                      persistent_workers=workers > 0,
                      prefetch_factor=PREFETCH_FACTOR if workers else None)


def build_job(cfg: TrainConfig, rt: Runtime):
    """Data, model, optimizer and scheduler for `cfg`, prepared for the runtime's strategy."""
    image_size = cfg.image_size or default_image_size(cfg.model)
    data = load_data(cfg.data, input_kind=model_input_kind(cfg.model), image_size=image_size,
                     seq_length=cfg.seq_length, future_length=cfg.future_length)
    model = build_model(cfg.model, data.input_shape, data.num_outputs)
    settings = StepSettings.for_data(data.normalize, rt.device, clip_grad_norm=cfg.clip_grad_norm,
                                     channels_last=rt.device.type == "cuda" and is_convnet(cfg.model))
    if settings.channels_last:
        model = model.to(memory_format=torch.channels_last)
    workers = loader_workers(cfg, rt)
    train_loader = make_loader(data.train, cfg.batch_size, True, workers, cfg.drop_last)
    val_loader = make_loader(data.val, cfg.batch_size, False, workers)
    model, train_loader, val_loader = rt.prepare(model, train_loader, val_loader)
    model = compile_prepared(cfg, rt, model)
    optimizer = make_optimizer(cfg, rt.strategy.unwrap(model), rt.device)
    scheduler = make_scheduler(cfg, optimizer)
    return data, model, optimizer, scheduler, train_loader, val_loader, settings


# --- the job --------------------------------------------------------------------------------------

def run_training(cfg: TrainConfig, *, device_ids: list[int] | None = None,
                 accelerator: str = "auto") -> dict:
    rt = setup(cfg.strategy, cfg.precision, devices=device_ids, accelerator=accelerator,
               seed=cfg.seed, accumulate=cfg.accumulate,
               ddp=ddp_options(cfg))
    console.configure(rt.is_main)
    if rt.device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest conv kernels
    out = _agree_on_out(cfg, rt)
    data, model, optimizer, scheduler, train_loader, val_loader, settings = build_job(cfg, rt)
    classification = data.task == "classification"
    loss_fn = nn.functional.cross_entropy if classification else nn.functional.mse_loss

    resolved = {**asdict(cfg), "out": str(out), "precision": rt.precision.kind,
                "strategy": rt.strategy.name, "world_size": rt.world_size,
                "global_batch": cfg.batch_size * rt.strategy.devices_per_process * rt.world_size,
                "train_size": len(data.train), "val_size": len(data.val), "task": data.task}
    if rt.is_main:
        (out / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    console.info(f"multigpu train: {cfg.model} on {data.name} ({len(data.train)} train / "
                 f"{len(data.val)} val), {rt.strategy.describe()}, {rt.precision.kind}, "
                 f"global batch {resolved['global_batch']} -> {out}")

    best, record, step, first_epoch = None, {}, 0, 1
    ckpt = resume_checkpoint(cfg, out)
    if ckpt is not None:
        state = rt.load(ckpt, model=model, optimizer=optimizer, scheduler=scheduler)
        first_epoch, step, best = state["epoch"] + 1, state["step"], state.get("best")
        train_loader.set_epoch(state["epoch"])  # the data order goes on where it stopped
        console.info(f"resumed from {ckpt} (epoch {state['epoch']}, step {step}, saved by "
                     f"{state.get('world_size')} x {state.get('strategy')})")
    for epoch in range(first_epoch, cfg.epochs + 1):
        record = {"epoch": epoch, "lr": optimizer.param_groups[0]["lr"]}
        try:
            record |= train_epoch(rt, model, optimizer, loss_fn, train_loader, settings,
                                  description=f"epoch {epoch}/{cfg.epochs}")
        except torch.cuda.OutOfMemoryError:
            raise UsageError(_oom_message(cfg, rt)) from None
        rt.sync_buffers(model)  # every rank evaluates rank 0's model, the one saved below
        record |= evaluate(rt, model, loss_fn, val_loader, classification, settings)
        if rt.precision.scaler is not None:
            record["skipped_steps"] = rt.precision.skipped_steps
        step += len(train_loader)
        if scheduler is not None:
            scheduler.step()
        score = record["val_accuracy"] if classification else -record["val_loss"]
        improved = best is None or score > best
        best = score if improved else best
        # Checkpoint before the metrics line: a crash in between loses the line, never writes
        # an epoch twice after the automatic resume.
        rt.save(out / "checkpoints" / "last.pt", model=model, optimizer=optimizer,
                scheduler=scheduler, epoch=epoch, step=step, best=best, metrics=record,
                config=resolved)
        if improved and rt.is_main:
            atomic_copy(out / "checkpoints" / "last.pt", out / "checkpoints" / "best.pt")
        _report(rt, out, record, classification)
    # Every rank done with its collectives before any tears down: a gloo rank that exits while a
    # peer's last exchange is in flight can abort ("terminate called without an active
    # exception", seen once in 4-process runs here).
    rt.env.barrier()
    destroy_distributed()
    return record


def _oom_message(cfg: TrainConfig, rt: Runtime) -> str:
    """Trap 2: say what ran out and the three ways out, instead of the allocator's dump."""
    total = torch.cuda.get_device_properties(rt.device).total_memory / 2**30
    smaller = max(1, cfg.batch_size // 2)
    return (f"CUDA out of memory on {rt.device} ({total:.0f} GiB) with --batch-size "
            f"{cfg.batch_size} per GPU and --precision {rt.precision.kind}: use --batch-size "
            f"{smaller} (add --accumulate {2 * cfg.accumulate} to keep the global batch), or "
            "--precision bf16; `multigpu gpus` shows what else holds memory")


def _agree_on_out(cfg: TrainConfig, rt: Runtime) -> Path:
    """Rank 0 reserves the run folder and tells the others (the same name on every rank)."""
    result = None
    if rt.is_main:
        try:
            result = str(reserve_out(cfg))
        except UsageError as exc:
            result = exc
    result = rt.env.broadcast_object(result)
    if isinstance(result, UsageError):
        raise result
    return Path(result)


def _report(rt: Runtime, out: Path, record: dict, classification: bool) -> None:
    if not rt.is_main:
        return
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    acc = f"  val_acc {record['val_accuracy']:.2%}" if classification else ""
    console.info(f"epoch {record['epoch']}  train_loss {record['train_loss']:.4f}  "
                 f"val_loss {record['val_loss']:.4f}{acc}  "
                 f"({record['train_samples']} train / {record['val_samples']} val samples)  "
                 f"{record['epoch_seconds']:.1f} s  {record['samples_per_second']:,.0f} samples/s")
