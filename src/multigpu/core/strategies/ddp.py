"""DistributedDataParallel: one process per device, gradients all-reduced in buckets during backward."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multigpu.core.distributed import DistEnv, nccl_group_with_max_ctas
from multigpu.core.errors import Api, Text, UsageError
from multigpu.core.strategies.base import Strategy


@dataclass(frozen=True)
class DDPOptions:
    """Knobs of torch's DDP engine. The defaults are chosen for speed; see docs/performance.md."""
    # 100 MB, not torch's 25: fewer, larger all-reduces that compete less with the backward's
    # kernels. ResNet-50 bf16 batch 128 on 4x H200: 16,200 img/s against 14,512 and 15,094 for
    # two runs at 25 MB, in one run (docs/performance.md).
    bucket_cap_mb: float = 100.0
    # Gradients live inside the all-reduce buckets: no copy in or out of them, less memory.
    gradient_as_bucket_view: bool = True
    # Off by default: a parameter that gets no gradient is reported by name at the first
    # backward (see Runtime), which is faster and clearer than searching for it every step.
    find_unused_parameters: bool = False
    static_graph: bool = False
    # True (torch's default): rank 0's buffers (BatchNorm running statistics, ...) are copied to
    # every rank before every forward: one more collective per step, ~160 small copies for
    # ResNet-50, and a point where every rank waits for the slowest. False: each rank updates its
    # own, they are made equal once when wrapping, and Runtime.sync_buffers() copies rank 0's
    # before an evaluation on every rank. `multigpu train` uses False (training.ddp_options).
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False
    # NCCL only: the most SMs the gradient all-reduce may take from the backward's kernels
    # (NCCL's maxCTAs, in a process group of the model's own). None: NCCL's choice.
    nccl_max_ctas: int | None = None

    def __post_init__(self):
        if self.nccl_max_ctas is not None and self.nccl_max_ctas < 1:
            raise UsageError(f"DDPOptions(nccl_max_ctas={self.nccl_max_ctas}): give at least 1 "
                             "(thread blocks, one SM each), or None for NCCL's own choice")


class DDP(Strategy):
    name = "ddp"
    options_type = DDPOptions

    def __init__(self, env: DistEnv, options: DDPOptions | None = None):
        super().__init__(env)
        self.options = options or DDPOptions()

    @classmethod
    def create(cls, env: DistEnv, *, device_ids: tuple[int, ...] = (),
               options: object | None = None) -> DDP:
        return cls(env, cls.own_options(options))

    def setup_module(self, model: nn.Module) -> nn.Module:
        o = self.options
        if o.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(self.device)
        if not self.env.is_distributed:  # ddp asked for in one process: nothing to synchronise
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        extra = {} if o.broadcast_buffers else _no_forward_buffer_sync(self.env, model)
        if o.nccl_max_ctas is not None:
            extra["process_group"] = nccl_group_with_max_ctas(o.nccl_max_ctas)
        return DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=o.bucket_cap_mb,
            gradient_as_bucket_view=o.gradient_as_bucket_view,
            find_unused_parameters=o.find_unused_parameters, static_graph=o.static_graph, **extra)

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        # What DDP.no_sync() toggles; DDP reads it at the start of forward, so this must be set
        # before the micro-batch's forward (the prepared loader does it as it yields the batch).
        if isinstance(model, DistributedDataParallel):
            model.require_backward_grad_sync = enabled

    def check_unused(self, models: list[nn.Module]) -> None:
        """Trap 6: DDP fails one step later, cryptically, when a parameter got no gradient."""
        o = self.options
        if not self.env.is_distributed or o.find_unused_parameters or o.static_graph:
            return
        for model in models:
            refuse_unused(self.unwrap(model), "DDP", Api(
                "DDPOptions.find_unused_parameters", True,
                text="setup(ddp=DDPOptions(find_unused_parameters=True))"))

    def describe(self) -> str:
        return f"ddp ({self.env.world_size} processes, {self.env.backend})"


def refuse_unused(model: nn.Module, engine: str, option: Api) -> None:
    """UsageError naming every trainable parameter of `model` without a gradient after a
    backward, with the fixes (none when no parameter has one: a model outside this loss);
    `option`: the argument that lets `engine` run with them."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    unused = [n for n, p in params if p.grad is None]
    if unused and len(unused) < len(params):
        shown = ", ".join(unused[:8]) + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else "")
        raise UsageError(Text(
            f"{len(unused)} parameter(s) got no gradient in the first backward: {shown}. "
            f"{engine} needs every trainable parameter to take part in the loss: remove the "
            "unused module, freeze it (requires_grad_(False)), or pass {}", option))


def _no_forward_buffer_sync(env: DistEnv, model: nn.Module) -> dict:
    """DDP's keyword that stops the copy of rank 0's buffers before every forward, by feature
    check: torch 2.13 renamed `broadcast_buffers` to `forward_sync_buffers` and warns
    (FutureWarning) when the old name is passed; 2.11 knows only the old one."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}  # buffers still made equal once, when wrapping
    # the old keyword also leaves the buffers out of DDP's initial sync: make them equal here
    env.broadcast_tensors(list(model.buffers()))
    return {"broadcast_buffers": False}
