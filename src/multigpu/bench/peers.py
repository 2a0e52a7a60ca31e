"""The three peer recipes, each written the way its documentation shows, on the same model and data.

- ddp:        plain torch.distributed + DistributedDataParallel, the usual torchrun recipe
              (autocast around the forward, GradScaler only for fp16, default DDP options).
- accelerate: Accelerator(mixed_precision=...), accelerator.prepare(model, optimizer),
              accelerator.backward(loss).
- fabric:     Fabric(accelerator="cuda", devices=N, strategy="ddp", precision="...-mixed"),
              fabric.launch(), fabric.setup(model, optimizer), fabric.backward(loss).

They run in processes started by our launcher (torchrun), after multigpu-ddp in the same process:
the hand-written recipe reuses the default process group when one exists, Accelerate's
PartialState and Fabric's _init_dist_connection do the same by themselves.
Every recipe uses torch's default SGD (lr 0.1, momentum 0.9), as the recipes do; multigpu uses
its own optimizer factory (fused SGD on GPUs, foreach under fsdp: training.kernel_options),
which each row records.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from multigpu.bench.measure import Prepared, describe_optimizer, synthetic_batch
from multigpu.bench.spec import Task
from multigpu.train.models.catalog import build_model, is_convnet
from multigpu.train.models.model_names import precision_for
from multigpu.core.precision import resolve_precision

SEED = 0  # same initial weights as multigpu's setup(seed=0)


def _model(task: Task, channels_last: bool):
    torch.manual_seed(SEED)
    model = build_model(task.model, (3, task.image_size, task.image_size), task.num_outputs)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _local_device(accelerator: str) -> torch.device:
    if accelerator != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _precision(task: Task, device: torch.device) -> str:
    """The precision a peer runs `task` in: as multigpu's methods resolve it."""
    return resolve_precision(precision_for(task.precision, task.model), device)


def build_ddp(task: Task, accelerator: str) -> Prepared:
    device = _local_device(accelerator)
    cuda = device.type == "cuda"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    kind = _precision(task, device)
    channels_last = cuda and is_convnet(task.model)
    model = torch.nn.parallel.DistributedDataParallel(
        _model(task, channels_last).to(device), device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = synthetic_batch(task.batch_size, task, device, channels_last, seed=1 + dist.get_rank())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kind)
    scaler = torch.amp.GradScaler(device.type) if kind == "fp16" else None
    global_batch = task.batch_size * dist.get_world_size()

    def step() -> int:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return global_batch

    return Prepared(step, [device], {"precision": kind, "optimizer": describe_optimizer(optimizer),
                                     "wrapper": type(model).__name__,
                                     "world_size": dist.get_world_size()})


def build_accelerate(task: Task, accelerator: str) -> Prepared:
    from accelerate import Accelerator

    device = _local_device(accelerator)
    kind = _precision(task, device)
    acc = Accelerator(mixed_precision={"bf16": "bf16", "fp16": "fp16"}.get(kind, "no"))
    channels_last = acc.device.type == "cuda" and is_convnet(task.model)
    model = _model(task, channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = acc.prepare(model, optimizer)
    x, y = synthetic_batch(task.batch_size, task, acc.device, channels_last, seed=1 + acc.process_index)
    step = _library_step(model, optimizer, acc.backward, x, y, task.batch_size * acc.num_processes)
    info = {"precision": kind, "optimizer": describe_optimizer(optimizer),
            "wrapper": type(model).__name__, "world_size": acc.num_processes}
    return Prepared(step, [acc.device], info, close=acc.free_memory)


def build_fabric(task: Task, accelerator: str) -> Prepared:
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric

    device = _local_device(accelerator)
    kind = _precision(task, device)
    precision = {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(kind, "32-true")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    fabric = Fabric(accelerator="cuda", devices=local_world, strategy="ddp", precision=precision)
    fabric.launch()  # under torchrun: no new processes, joins the existing process group
    channels_last = is_convnet(task.model)
    model = _model(task, channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = synthetic_batch(task.batch_size, task, fabric.device, channels_last,
                           seed=1 + fabric.global_rank)
    step = _library_step(model, optimizer, fabric.backward, x, y,
                         task.batch_size * fabric.world_size)
    info = {"precision": kind, "optimizer": describe_optimizer(optimizer),
            "wrapper": type(getattr(model, "_forward_module", model)).__name__,
            "world_size": fabric.world_size}
    return Prepared(step, [fabric.device], info)


def _library_step(model, optimizer, backward, x, y, global_batch: int):
    """The training step both libraries document: their backward (it applies their precision and
    loss scaling), then the optimizer's step."""
    def step() -> int:
        optimizer.zero_grad(set_to_none=True)
        backward(F.cross_entropy(model(x).float(), y))
        optimizer.step()
        return global_batch
    return step


BUILDERS = {"ddp": build_ddp, "accelerate": build_accelerate, "fabric": build_fabric}
