"""The main job behind `multigpu train`: built-in model + data spec -> a run folder.

Runs in every worker process (or in the one process). It reads only the launcher's environment;
choosing devices and starting processes is the CLI's business (multigpu.cli.train). The run
folder is described in runfolder.py, its checkpoints in checkpoint_store.py; where a run resumes
from is decided once, on rank 0 (runstate.py); when to save and stop, at the same step on every
rank (control.py); the epoch loop is in trainloop.py.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from multigpu.train.data import data_specs, imagefolder
from multigpu.train import global_batch
from multigpu.train.rundir import provenance
from multigpu.core import compiling, console
from multigpu.train.settings.config import TrainConfig, flatten
from multigpu.train.data.datasets import BatchedWindows, DataBundle, WindowDataset, load_data
from multigpu.train.engine import StepSettings
from multigpu.train.plan import RunPlan, decode_path
from multigpu.train.models.catalog import build_model, default_image_size, is_convnet, model_input_kind
from multigpu.core.runtime import Runtime
from multigpu.core.loading.loader_workers import own_group_context
from multigpu.core.system.cpu_placement import Placement
from multigpu.core.strategies import DDPOptions, FSDPOptions, registry

IN_MEMORY_DATA = ("digits", "timeseries:")
MAX_WORKERS = 16      # DataLoader workers per rank, at most
PREFETCH_FACTOR = 4   # batches each worker keeps ready


# --- building blocks ------------------------------------------------------------------------------

def strategy_options(cfg: TrainConfig) -> tuple:
    """The options objects of every strategy for `cfg`; the run's strategy takes its own."""
    return ddp_options(cfg), FSDPOptions(cpu_offload=cfg.parallel.fsdp_cpu_offload,
                                         activation_checkpointing=cfg.parallel.activation_checkpointing)


def ddp_options(cfg: TrainConfig) -> DDPOptions:
    """The DDP settings of `multigpu train` (and of bench's multigpu-ddp). Buffers are not copied
    from rank 0 at every forward: the training forward of BatchNorm does not read its running
    statistics, and run_training copies rank 0's to every rank before each evaluation instead.
    On 2x H200, ResNet-50 bf16, that made the step 4-15 % faster at batch 32-128 in two runs
    (docs/performance.md)."""
    return DDPOptions(find_unused_parameters=cfg.parallel.find_unused_parameters, broadcast_buffers=False)


# --compile auto turns CUDA graphs on from this many optimizer steps in the run. Measured on one
# H100, ResNet-50 bf16 batch 128: CUDA graphs save 10.5 ms a step (34.2 -> 23.7 ms, `multigpu
# bench`) and their first epoch took 46 s longer than eager's with an empty compile cache, 5 s
# longer from the cache (docs/performance.md).
# The rule takes the empty cache's cost. Where the input pipeline limits the step (that run's
# synthetic: data, made on the CPU, did), the graphs save less.
AUTO_COMPILE_S, AUTO_SAVED_MS = 46.0, 10.5
AUTO_MIN_STEPS = int(AUTO_COMPILE_S * 1000 / AUTO_SAVED_MS)


def auto_mode(device_type: str, strategy: str, accumulate: int, steps: int) -> tuple[str | None, str]:
    """--compile auto: (the mode, the line that says why). CUDA graphs where they can work and the
    run has at least AUTO_MIN_STEPS optimizer steps to win their compiling back; else no compiling."""
    off = "--compile auto: not compiled"
    if device_type != "cuda":
        return None, f"{off} (CUDA graphs need GPUs)"
    if not registry.info(strategy).cuda_graphs or accumulate > 1:
        why = f"--accumulate {accumulate}" if accumulate > 1 else f"--strategy {strategy}"
        return None, f"{off} (CUDA graphs cannot work with {why})"
    if steps < AUTO_MIN_STEPS:
        return None, (f"{off}: {steps:,} steps are too few to win back compiling (about "
                      f"{AUTO_COMPILE_S:.0f} s; from {AUTO_MIN_STEPS:,} steps CUDA graphs are used)")
    return "reduce-overhead", (f"--compile auto: CUDA graphs (reduce-overhead) for {steps:,} steps; "
                               "the first steps compile, the compile cache is kept for the next run")


def compile_mode(cfg: TrainConfig, rt: Runtime, steps: int | None = None) -> str | None:
    """--compile's mode (None: not compiled), once the run's devices, strategy and accumulation
    are known to allow it. `steps`: the run's optimizer steps, which --compile auto decides on
    (and says so)."""
    mode = cfg.compile
    if mode == "auto":
        mode, why = auto_mode(rt.device.type, rt.strategy.name, rt.accumulate, steps or 0)
        console.info(why)
    compiling.check(mode, rt.device.type, rt.strategy.name, rt.accumulate)
    return mode


def compile_prepared(cfg: TrainConfig, rt: Runtime, model: nn.Module, steps: int | None = None) -> nn.Module:
    """The prepared model, compiled in compile_mode's mode (unchanged without one)."""
    return compiling.compile_model(model, compile_mode(cfg, rt, steps))


def learning_rate(cfg: TrainConfig) -> float:
    return cfg.optim.learning_rate


def image_size(cfg: TrainConfig) -> int | None:
    """The image side the data is made at (synthetic images, folder: data); others have none."""
    made = data_specs.is_images(cfg.input.data) or (cfg.input.data.startswith("synthetic:")
                                              and model_input_kind(cfg.model) == "image")
    return (cfg.input.image_size or default_image_size(cfg.model)) if made else cfg.input.image_size


# The optimizers --optimizer offers. Their fused CUDA kernels do one launch for all parameters
# instead of several per tensor; torch's DTensor (fsdp's sharded parameters) has sharding rules for
# the fused Adam and AdamW ops (torch/distributed/tensor/_ops/_pointwise_ops.py, torch 2.11 and
# 2.13) but none for fused SGD's: `aten._fused_sgd_.default does not have a sharding strategy
# registered`. The foreach kernels (a few launches per group of tensors) have rules for all three.
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
FUSED_ON_DTENSORS = frozenset({"adam", "adamw"})


def kernel_options(optimizer: str, device_type: str, dtensors: bool) -> dict:
    """The implementation `optimizer` steps with: fused on CUDA where the parameters' tensor type
    can dispatch its fused op, foreach elsewhere. Where the parameters are decides, not the run's
    device: fsdp's CPU offload keeps them on the CPU."""
    if device_type == "cuda" and (not dtensors or optimizer in FUSED_ON_DTENSORS):
        return {"fused": True}
    return {"foreach": True}


def holds_dtensors(params: list[torch.Tensor]) -> bool:
    """Whether any parameter is a DTensor (fsdp shards them so); without torch's DTensor module
    loaded there can be none, and importing it would cost a plain run about 0.4 s."""
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(isinstance(p, module.DTensor) for p in params)


def make_optimizer(cfg: TrainConfig, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
    """`lr`: the run's plan's (default: learning_rate's rule)."""
    lr = learning_rate(cfg) if lr is None else lr
    params = [p for p in model.parameters() if p.requires_grad]
    kernel = kernel_options(cfg.optim.optimizer, params[0].device.type if params else "cpu",
                            holds_dtensors(params))
    if cfg.optim.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=cfg.optim.weight_decay, **kernel)
    return OPTIMIZERS[cfg.optim.optimizer](params, lr=lr, weight_decay=cfg.optim.weight_decay, **kernel)


def make_scheduler(cfg: TrainConfig, optimizer):
    if cfg.optim.scheduler == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.optim.step_size,
                                               gamma=cfg.optim.gamma)
    if cfg.optim.scheduler == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(cfg.epochs, 1))
    return None


def cores_per_process(rt: Runtime, placement: Placement | None = None) -> int:
    """The CPU cores this process may use, shared out among the node's training processes; with
    a CPU placement, its share (the main thread's affinity is its core alone then)."""
    if placement is not None:
        return len(placement.main) + len(placement.workers)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(rt.env.local_world_size, 1))


def loader_workers(cfg: TrainConfig, rt: Runtime, placement: Placement | None = None) -> int:
    """--workers, else 0 for in-memory data, else one per CPU of the rank's share but one (the
    main process's), or with a CPU placement one per CPU the placement gives the workers; at most
    MAX_WORKERS."""
    if cfg.input.workers is not None:
        return cfg.input.workers
    if cfg.input.data.startswith(IN_MEMORY_DATA):
        return 0  # tensors already in memory: worker processes would only add IPC
    if placement is not None:
        return min(MAX_WORKERS, len(placement.workers))
    return max(1, min(MAX_WORKERS, cores_per_process(rt) - 1))


def make_loader(dataset, batch_size: int, shuffle: bool, workers: int,
                drop_last: bool = False, cpus: tuple[int, ...] | None = None) -> DataLoader:
    """The run's DataLoader; its workers on `cpus` where given (a CPU placement's)."""
    if isinstance(dataset, WindowDataset):  # timeseries: a batch by two gathers, not B slices
        dataset = BatchedWindows(dataset)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=workers,
                      drop_last=drop_last, collate_fn=getattr(dataset, "collate", None),
                      persistent_workers=workers > 0,
                      prefetch_factor=PREFETCH_FACTOR if workers else None,
                      multiprocessing_context=own_group_context(None, cpus) if workers and cpus else None)


@dataclass
class Job:
    """Everything one training run works on, prepared for the runtime's strategy."""
    data: DataBundle
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object | None
    train_loader: object
    val_loader: object
    settings: StepSettings
    plan: RunPlan  # what the run worked out from its config, runtime and data, once
    decode: object | None = None  # --decode auto's trial (decode_choice.DecodeTrial), set by the run
    placement: Placement | None = None  # --cpu-placement auto, applied (train/cpu_placing.py)

    @property
    def classification(self) -> bool:
        return self.data.task == "classification"

    @property
    def loss_fn(self) -> Callable:
        return nn.functional.cross_entropy if self.classification else nn.functional.mse_loss


def load_run_data(cfg: TrainConfig) -> DataBundle:
    """The data of `--data` as the run's model takes it (also read by doctor and batchfit)."""
    return load_data(cfg.input.data, input_kind=model_input_kind(cfg.model),
                     image_size=image_size(cfg) or default_image_size(cfg.model),
                     seq_length=cfg.input.seq_length, future_length=cfg.input.future_length,
                     bad_images=cfg.input.bad_images)


def uses_channels_last(rt: Runtime, model: str) -> bool:
    """Built-in convnets on GPUs train in channels_last (NHWC weights and inputs), unless the
    strategy keeps its parameters contiguous (fsdp: FSDP2 shards only contiguous parameters)."""
    return (rt.device.type == "cuda" and is_convnet(model)
            and registry.info(rt.strategy.name).channels_last)


def cudnn_autotunes(cfg: TrainConfig, device_type: str) -> bool:
    """Whether the run has cuDNN time its convolution algorithms at the first step
    (torch.backends.cudnn.benchmark): on GPUs with `--cudnn-benchmark on`, never with
    `--deterministic` (the timing's choice may differ from run to run)."""
    return device_type == "cuda" and cfg.cudnn_benchmark == "on" and not cfg.deterministic


def build_job(cfg: TrainConfig, rt: Runtime, mark: Callable[[str], None] = lambda part: None,
              head=None, decode_trial: bool = False, placement: Placement | None = None,
              start_workers: bool = False) -> Job:
    """Data, model, optimizer and scheduler for `cfg`, prepared for the runtime's strategy.
    `mark(part)` is called as each part of the start-up ends (timeline.Timeline.mark): decoder
    (folder: data: importing torchvision, where it is, to choose it), data, loaders (with
    `start_workers`: the training loader's workers started), model, prepare (the strategy's
    wrapping: DDP's constructor imports torch's compiler and broadcasts the weights), optimizer
    (torch imports its compiler with the first one, where DDP did not).
    `head`: the run's head_start.HeadStart, whose thread did the decoder, the folder's listing and
    the compiler's import meanwhile: data is then the wait for them, prepare the wait for it.
    `placement`: the rank's CPU placement (train/cpu_placing.py), whose worker CPUs the loaders'
    workers run on. `start_workers`: a run that begins at its first step starts the training
    loader's workers before the model is wrapped, so that its first batches are made meanwhile
    (PreparedLoader.start_workers), with `head`'s thread paused between two imports for the fork:
    before the model is built where the thread already stands there (it loaded the data), else
    after, where its imports of the compiler's modules have had the model's time to end. The
    job's `plan` holds what was worked out on the way (RunPlan)."""
    in_line = head is None or not head.loads_data
    if in_line and data_specs.is_images(cfg.input.data):
        imagefolder.default_decoder()  # decided (and cached) here, so that it is timed apart
        mark("decoder")
    data = load_run_data(cfg) if in_line else head.data()
    mark("data")
    workers = loader_workers(cfg, rt, placement)
    train_loader, val_loader = _loaders(cfg, rt, data, workers, placement, decode_trial)
    early = getattr(train_loader, "start_workers", None) if start_workers and workers else None
    if early is not None and (head is None or head.parked()):  # now, else once the model is built
        _fork_workers(early, cfg, head, mark)
        early = None
    elif early is None and head is not None:
        head.release()
    model = build_model(cfg.model, data.input_shape, data.num_outputs)
    settings = StepSettings.for_data(data.normalize, rt.device, clip_grad_norm=cfg.optim.clip_grad_norm,
                                     channels_last=uses_channels_last(rt, cfg.model))
    if settings.channels_last:
        model = model.to(memory_format=torch.channels_last)
    mark("model")
    if early is not None:
        _fork_workers(early, cfg, head, mark)
    if head is not None:
        head.imports_done()  # its modules complete before the wrapping uses them
    model = rt.prepare(model)
    mode = compile_mode(cfg, rt, steps=cfg.epochs * _length(train_loader) // rt.accumulate)
    model = compiling.compile_model(model, mode)
    mark("prepare")
    plan = _plan(cfg, rt, workers, mode, decode_path(data), placement)
    optimizer = make_optimizer(cfg, rt.strategy.unwrap(model), plan.lr)
    scheduler = make_scheduler(cfg, optimizer)
    mark("optimizer")
    return Job(data, model, optimizer, scheduler, train_loader, val_loader, settings, plan,
               placement=placement)


def _fork_workers(start: Callable[[int], bool], cfg: TrainConfig, head, mark) -> None:
    """The training loader's workers started (PreparedLoader.start_workers) while the head start's
    thread imports nothing (head_start.py: a fork in an import leaves its locks held in the child)."""
    with head.paused() if head is not None else contextlib.nullcontext():
        start(cfg.epochs - 1)
    mark("loaders")


def _loaders(cfg: TrainConfig, rt: Runtime, data: DataBundle, workers: int,
             placement: Placement | None, decode_trial: bool) -> tuple:
    """The training and evaluation loaders, prepared (the decode's way chosen first: the workers
    it leaves a share of the decoding to are started with the loaders)."""
    cpus = placement.workers if placement is not None else None
    decode_note = imagefolder.use_decode(data, cfg.input.decode, rt.device, workers, cfg.deterministic,
                                         trial=decode_trial)
    if decode_note:
        console.info(decode_note)
    train_loader = make_loader(data.train, cfg.input.batch_size, True, workers, cfg.input.drop_last, cpus)
    per_step = cfg.input.batch_size * rt.world_size * rt.strategy.devices_per_process
    val_batches = -(-len(data.val) // per_step)  # a rank's, at most
    val_loader = make_loader(data.val, cfg.input.batch_size, False, min(workers, val_batches), cpus=cpus)
    return rt.prepare(train_loader, val_loader)


def _plan(cfg: TrainConfig, rt: Runtime, workers: int, mode: str | None, decode: str | None,
          placement: Placement | None) -> RunPlan:
    """The run's plan once its loaders are prepared (a global batch's plan is made then)."""
    split = rt.batch_plan  # --global-batch-size: its micro-batch and accumulation
    batch = split.micro if split is not None else cfg.input.batch_size
    devices = rt.strategy.devices_per_process * rt.world_size
    return RunPlan(image_size=image_size(cfg), workers=workers, lr=learning_rate(cfg), batch_size=batch,
                   accumulate=rt.accumulate,
                   global_batch=split.global_batch if split is not None else cfg.input.batch_size * devices,
                   compile=mode, decode=decode,
                   cpu_placement=placement.record() if placement is not None else None)


def _length(loader) -> int:
    """Steps of an epoch; 0 for a loader over a stream, which has no length."""
    try:
        return len(loader)
    except TypeError:
        return 0


def resolved_config(cfg: TrainConfig, rt: Runtime, job: Job, out: Path, launch: dict) -> dict:
    """config.json: every setting as it was resolved for this run (given back to `--config`, it
    repeats the run), facts about the run (configfile.RUN_FACTS) and its provenance (`launch`:
    provenance.launch_facts). Collective."""
    plan = job.plan
    return {**flatten(cfg), "out": str(out), "lr": plan.lr, "image_size": plan.image_size,
            "workers": plan.workers, "precision": rt.precision.kind,
            "strategy": rt.strategy.name, "world_size": rt.world_size,
            "global_batch": plan.global_batch, "plan": plan.record(),
            "train_size": len(job.data.train), "val_size": len(job.data.val), "task": job.data.task,
            "input_shape": list(job.data.input_shape), "num_outputs": job.data.num_outputs,
            "provenance": provenance.run_facts(rt, launch), **global_batch.config_facts(rt.batch_plan)}


def oom_message(cfg: TrainConfig, rt: Runtime) -> str:
    """Trap 2: say what ran out, how the GPU's memory was shared, and the ways out, instead of
    the allocator's dump."""
    gib = 2**30
    total = torch.cuda.get_device_properties(rt.device).total_memory
    peak = torch.cuda.max_memory_allocated(rt.device)
    free, _ = torch.cuda.mem_get_info(rt.device)
    others = max(0, total - free - torch.cuda.memory_reserved(rt.device))
    smaller = max(1, cfg.input.batch_size // 2)
    return (f"CUDA out of memory on {rt.device} ({total / gib:.0f} GiB: this run's peak "
            f"{peak / gib:.1f} GiB, other processes {others / gib:.1f} GiB) with --batch-size "
            f"{cfg.input.batch_size} per GPU and --precision {rt.precision.kind}: use --batch-size auto "
            f"(the largest that fits, found at the start) or --batch-size {smaller} (add "
            f"--accumulate {2 * cfg.optim.accumulate} to keep the global batch), or --precision bf16; "
            "`multigpu doctor` measures a step's peak before a run")
