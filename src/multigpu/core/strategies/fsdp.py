"""FSDP2 (torch's `fully_shard`): each process keeps 1/N of the parameters, gradients and
optimizer state, and gathers a block's parameters only while that block computes.

For models whose weights, gradients and Adam state do not fit one GPU next to the activations.
With N processes a block's parameters are all-gathered before its forward and backward and its
gradients reduce-scattered after the backward: about 1.5x the traffic of DDP's all-reduce, for
1/N of the memory of the model's state.

- Shard units: `FSDPOptions.shard_modules` (classes, e.g. your transformer block), or by default
  every item of an nn.Sequential / nn.ModuleList / nn.ModuleDict with at least `min_params`
  parameters (ResNet's bottlenecks, Swin's and nn.TransformerEncoder's blocks, VGG's large
  layers), found from the root down; the root holds the rest.
- Initial weights: rank 0's, copied to every rank before sharding (as DDP does), so the shards
  of a model initialised with per-rank seeds are one model.
- Precision: with bf16/fp16, parameters are gathered and computed in that dtype and gradients
  reduced in fp32 (FSDP2's MixedPrecisionPolicy). A model with BatchNorm keeps fp32 parameters:
  autocast computes in the low dtype and the running statistics stay exact.
- Gradient accumulation reduces every micro-batch's gradients into the shards (see
  set_grad_sync): the memory of one shard, not of the whole gradient.
- fp16 loss scaling agrees across ranks on a skipped step: torch's GradScaler, whose inf/NaN check
  on sharded gradients (DTensors) is reduced over every rank by DTensor itself. (FSDP1's
  ShardedGradScaler keeps its flag in a shape that CUDA's fused AdamW refuses: "output with shape
  [] doesn't match the broadcast shape [1]", torch 2.11 on an H100.)
- Checkpoints: `multigpu train` saves sharded ones, each rank writing its part with
  torch.distributed.checkpoint (sharded_checkpoint.py; `multigpu export` makes one file of one).
  `rt.save` gathers the whole model and the optimizer state (numbered as torch numbers it) onto
  rank 0's CPU into the usual single file. Both resume under ddp, single or fsdp, on any number
  of processes.
- In one process, with CPU offload, a group of that process alone is made: a model larger than
  its GPU trains there, the shards in host memory. Without offload one process shards nothing.
- CUDA graphs (--compile reduce-overhead) are not offered: FSDP2's collectives run outside them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from multigpu.core.checkpoints import checkpoint
from multigpu.core import console
from multigpu.core.distributed import DistEnv
from multigpu.core.errors import Api, Text, UsageError
from multigpu.core.strategies.base import Strategy

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_OFFLOAD = Api("FSDPOptions.cpu_offload", True, text="FSDPOptions(cpu_offload=True)")
OFFLOAD_NEEDS_GPUS = Text("fsdp's CPU offload moves the shards of GPUs to host memory; CPU "
                          "processes keep everything there already: leave {} out", _OFFLOAD)
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class FSDPOptions:
    """How the model is cut into shard units and when gathered weights are freed."""
    # Classes sharded as one unit each (e.g. (MyBlock,)); None: the automatic rule above.
    shard_modules: tuple[type, ...] | None = None
    # Automatic rule: a container's item with fewer parameters stays with its parent's unit
    # (one all-gather per tiny layer costs more time than the memory it saves).
    min_params: int = 100_000
    # Free each unit's gathered parameters after its forward (gathered again for the backward):
    # the memory of one unit at a time, at one more all-gather per unit. False keeps them.
    reshard_after_forward: bool = True
    # Keep the shards of parameters, gradients and optimizer state in host memory (FSDP2's
    # CPUOffloadPolicy): GPU memory for activations and one gathered unit only; the optimizer
    # steps on the CPU. For models whose shards do not fit the GPUs either.
    cpu_offload: bool = False
    # Recompute each shard unit's activations in the backward instead of keeping them
    # (torch.utils.checkpoint, non-reentrant): about a third more compute for much less memory.
    activation_checkpointing: bool = False


class FSDP(Strategy):
    name = "fsdp"
    options_type = FSDPOptions

    def __init__(self, env: DistEnv, options: FSDPOptions | None = None):
        super().__init__(env)
        self.options = options or FSDPOptions()
        self.precision = "fp32"
        self.units: list[str] = []          # module paths sharded as units, set by setup_module
        self.param_dtype: torch.dtype | None = None
        self.sharded = False                # set by setup_module: a process group to shard over

    @classmethod
    def create(cls, env: DistEnv, *, device_ids: tuple[int, ...] = (),
               options: object | None = None) -> FSDP:
        options = cls.own_options(options)
        if options is not None and options.cpu_offload and env.device.type != "cuda":
            raise UsageError(OFFLOAD_NEEDS_GPUS)
        return cls(env, options)

    def use_precision(self, kind: str) -> None:
        self.precision = kind

    def setup_module(self, model: nn.Module) -> nn.Module:
        if self.options.cpu_offload:  # (create() refused it without GPUs)
            if not dist.is_initialized():
                one_rank_group(self.device)  # one GPU, the shards in host memory: worth it
            # the model stays in host memory: fully_shard moves one unit at a time to the GPU
            # to cut its shards, so the whole model never has to fit there
        else:
            model = model.to(self.device)
        if not dist.is_initialized():  # one process without a group: nothing to shard over
            gpu = self.device.type == "cuda"
            offload = ", or add CPU offload ({}) to train a model larger than the GPU" if gpu else ""
            console.warn(Text("strategy 'fsdp' in one process has nothing to shard the model "
                              "over: it trains as {} would; launch several processes ({}, or "
                              f"cpu:2) to shard it{offload}", Api("setup.strategy", "single"),
                              Api("launch.devices", 2, text="`multigpu run --devices 2`"),
                              *([_OFFLOAD] if gpu else [])))
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                            fully_shard)

        for p in model.parameters():  # FSDP2 shards only contiguous ones (not NHWC weights)
            if not p.is_contiguous():
                p.data = p.data.contiguous()
        self.env.broadcast_tensors([*model.parameters(), *model.buffers()])  # rank 0's weights
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        self.param_dtype = None if has_bn else _LOW.get(self.precision)
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype,
                                      reduce_dtype=torch.float32 if self.param_dtype else None)
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        offload = CPUOffloadPolicy() if self.options.cpu_offload else OffloadPolicy()
        units = shard_units(model, self.options)
        if self.options.activation_checkpointing and not units:
            if self.env.is_main:
                console.warn("activation checkpointing recomputes the shard units, and this "
                             f"model has none (no container item with {self.options.min_params:,}+ "
                             "parameters): nothing is recomputed. Name the blocks with "
                             "FSDPOptions(shard_modules=(MyBlock,)) or lower min_params")
        names = {id(m): n for n, m in model.named_modules()}
        self.units = [names[id(u)] for u in units]
        for unit in units:
            if self.options.activation_checkpointing:
                recompute_in_backward(unit)
            fully_shard(unit, mesh=mesh, mp_policy=policy, offload_policy=offload,
                        reshard_after_forward=self.options.reshard_after_forward)
        # The root's parameters are used last in backward and first in forward: keep them.
        fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload,
                    reshard_after_forward=False)
        self.sharded = True
        return model

    @property
    def sharded_state(self) -> bool:
        return self.sharded

    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        """Gradients are reduce-scattered on every micro-batch, also with accumulation: FSDP2's
        set_requires_gradient_sync(False) would keep each unit's whole, unsharded gradient
        (fp32) until the last micro-batch, the memory this strategy exists to save. The sums
        are the same; each micro-batch costs one reduce-scatter more."""

    # --- checkpoints: the whole state, on rank 0 --------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict:
        if not self.sharded:
            return super().model_state_dict(model)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(self.unwrap(model), options=_full(gather=True))

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        if not self.sharded:
            return super().optimizer_state_dict(model, optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        named = get_optimizer_state_dict(self.unwrap(model), optimizer, options=_full(gather=True))
        return checkpoint.numbered_optimizer_state(named) if named else {}

    def load_model_state(self, model: nn.Module, state: dict) -> None:
        if not self.sharded:
            return super().load_model_state(model, state)
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        inner = self.unwrap(model)
        # a copy: torch puts the shards it cuts into the dict it is given
        set_model_state_dict(inner, dict(checkpoint.match_keys(inner.state_dict().keys(), state)),
                             options=_full(gather=False))

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             state: dict) -> None:
        if not self.sharded:
            return super().load_optimizer_state(model, optimizer, state)
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        if model is None:
            raise UsageError("under fsdp, load(optimizer=...) needs model= too: the optimizer's "
                             "state is matched to the model's sharded parameters")
        inner = self.unwrap(model)
        fqn = {id(p): n for n, p in inner.named_parameters()}
        order = [fqn[id(p)] for g in optimizer.param_groups for p in g["params"]]
        set_optimizer_state_dict(inner, optimizer, checkpoint.named_optimizer_state(state, order),
                                 options=_full(gather=False))

    def describe(self) -> str:
        if not self.sharded:
            return "fsdp (one process: nothing to shard)"
        dtype = {torch.bfloat16: ", bf16 parameters", torch.float16: ", fp16 parameters"}
        n, units = dist.get_world_size(), len(self.units) + 1
        extras = [name for name, on in (("CPU offload", self.options.cpu_offload),
                                        ("activation checkpointing",
                                         self.options.activation_checkpointing)) if on]
        return (f"fsdp ({n} process{'es' if n > 1 else ''}, {dist.get_backend()}, {units} shard "
                f"unit{'s' if units > 1 else ''}{dtype.get(self.param_dtype, '')}"
                + "".join(f", {e}" for e in extras) + ")")


def one_rank_group(device: torch.device) -> None:
    """A process group of this process alone (NCCL on its GPU), for FSDP2 in one process: with
    CPU offload a model larger than the GPU then trains on it, its shards in host memory. Torn
    down at exit."""
    import atexit

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


def shard_units(model: nn.Module, options: FSDPOptions) -> list[nn.Module]:
    """The submodules sharded as units of their own, in the order found from the root down. A
    unit's own submodules are never units: its parameters are gathered at once. A module that
    shares a parameter with modules outside it (tied embedding and output weights) cannot be a
    unit: FSDP2 manages each parameter in one unit only."""
    owners = _parameter_owners(model)
    if options.shard_modules:
        classes = tuple(options.shard_modules)
        units = _outermost([m for m in model.modules() if isinstance(m, classes) and m is not model])
        for unit in units:
            shared = _shared_outside(unit, owners)
            if shared:
                raise UsageError(f"FSDPOptions(shard_modules=...) names {type(unit).__name__}, but "
                                 f"one of them shares a parameter with {shared} outside it (tied "
                                 "weights), and FSDP2 shards each parameter in one unit only: "
                                 "leave that class out, or untie the weights")
        return units
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        in_container = isinstance(module, _CONTAINERS)
        for child in module.children():
            if (in_container and not isinstance(child, _CONTAINERS)
                    and sum(p.numel() for p in child.parameters()) >= options.min_params
                    and not _shared_outside(child, owners)):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


def _parameter_owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """Every parameter (by id) -> the modules that hold it directly, with their paths."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((f"{path}.{name}" if path else name, module))
    return owners


def _shared_outside(unit: nn.Module, owners: dict) -> str | None:
    """The path of a parameter of `unit` also held by a module outside it, or None."""
    inside = {id(m) for m in unit.modules()}
    for param in unit.parameters():
        for path, module in owners.get(id(param), ()):
            if id(module) not in inside:
                return path
    return None


def recompute_in_backward(module: nn.Module) -> None:
    """Activation checkpointing of `module`: its forward keeps only its inputs, and runs again
    in the backward (inside FSDP's gathering of the unit's parameters). Its parameter names do
    not change, so checkpoints stay loadable with and without it."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    def forward_recomputed_in_backward(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to keep, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = forward_recomputed_in_backward


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    inside = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inside]


def _full(gather: bool):
    """Whole (unsharded) state dicts; when saving, gathered onto rank 0's CPU memory only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=gather)
