"""Gradients averaged over the processes before every optimizer step, as DDP does, while the
script keeps its bare model object.

torch's composable DDP, `torch.distributed._composable.replicate(module)`, installs DDP's hooks on
a module in place: the module keeps its identity and its state dict keys (no `module.` prefix);
on its first forward it builds a DDP Reducer over its parameters, which broadcasts rank 0's
weights and buffers to every rank, then all-reduces (averages) the gradients in buckets while
backward runs. Rank 0's weights are sent once before that too, when the optimizer gets them, so
that a copy the script makes in between (an EMA) is the same on every rank.

Which module to replicate is decided when the script gives parameters to an optimizer
(Optimizer.add_param_group, which the optimizer's __init__ calls): the outermost modules that hold
those parameters. Modules are known from torch's global registration hooks (a parameter or a
submodule set on a module), so no model class is patched; a module made without them (a
copy.deepcopy, a whole model unpickled by torch.load) is found among the interpreter's objects.
DDP's hooks run in the forward of that outermost module, called as a module (a model, or its
DataParallel). One whose forward never ran so by its optimizer's first step (`self.forward(x)`,
a layer's method called from outside) has its gradients averaged at each optimizer step instead
(step_averaging.py).
"""
from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable

import torch
from torch import nn

from multigpu.auto.plain import plain_deepcopy, script_class
from multigpu.auto.step_averaging import StepAveraging
from multigpu.core.errors import UsageError


class ModuleRegistry:
    """Every module that got a parameter or a submodule since install(): weakly held."""

    def __init__(self):
        self.modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def install(self) -> None:
        from torch.nn.modules import module as torch_module

        def on_parameter(module, name, param):
            self.modules.add(module)

        def on_submodule(module, name, submodule):
            self.modules.add(module)
            if submodule is not None:
                self.modules.add(submodule)

        torch_module.register_module_parameter_registration_hook(on_parameter)
        torch_module.register_module_module_registration_hook(on_submodule)


def outermost_owners(params, modules) -> list[nn.Module]:
    """The modules of `modules` that hold any of `params` and are inside no other such module."""
    wanted = {id(p) for p in params}
    owners = [m for m in list(modules) if any(id(p) in wanted for p in m.parameters())]
    inside = {id(c) for m in owners for c in m.modules() if c is not m}
    return [m for m in owners if id(m) not in inside]


class GradientAveraging:
    """Replicates (composable DDP) the outermost modules of each optimizer's parameters, once."""

    def __init__(self, registry: ModuleRegistry, at_step: StepAveraging,
                 find_unused: bool = False, adopt: Callable[[nn.Module], None] | None = None):
        self.registry, self.at_step, self.find_unused = registry, at_step, find_unused
        self.adopt = adopt  # told of each module replicated (batchnorm.py's global statistics)
        # id of each parameter whose gradients are averaged already -> its replicated module
        self.covered: dict[int, weakref.ref] = {}
        # optimizer -> the modules it replicated; until its first step
        self.pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def on_param_group(self, optimizer, group: dict) -> None:
        trainable = [p for p in group["params"] if p.requires_grad]
        if not trainable:
            return
        pending = self.pending.setdefault(optimizer, [])  # its first step is checked
        params = [p for p in trainable if id(p) not in self.covered]
        if not params:
            return
        roots, loose = self._owners(params)
        if loose:  # modules made without registering (copy.deepcopy, torch.load of a whole model)
            self.registry.modules.update(  # type(), not isinstance: no __class__ property runs
                o for o in gc.get_objects() if issubclass(type(o), nn.Module))
            roots, loose = self._owners(params)
        if loose:
            raise UsageError(f"the script's {type(optimizer).__name__} holds {len(loose)} "
                             f"tensor(s) (shape {tuple(loose[0].shape)}) that belong to no "
                             "nn.Module: --auto averages the gradients of module parameters "
                             "only; make them nn.Parameter attributes of a module, or run "
                             "without --auto")
        from torch.distributed._composable import replicate

        for root in roots:
            replicate(root, **({"find_unused_parameters": True} if self.find_unused else {}))
            rank0_weights_now(root)
            type(root).__deepcopy__ = plain_deepcopy  # a class of its own: EMA copies, snapshots
            ref = weakref.ref(root)
            self.covered.update((id(p), ref) for p in root.parameters())
            if self.adopt is not None:
                self.adopt(root)
        pending.extend(roots)

    def _owners(self, params) -> tuple[list[nn.Module], list]:
        """The outermost known modules that hold `params`, and the parameters none holds."""
        roots = outermost_owners(params, self.registry.modules)
        held = {id(p) for r in roots for p in r.parameters()}
        return roots, [p for p in params if id(p) not in held]

    def before_step(self, optimizer, args, kwargs):
        """At an optimizer's first step: each module it replicated has run its forward, and got
        its gradients. An optimizer given a closure (LBFGS) runs the forward and backward inside
        its step: then they are looked at after the closure's backward, and its loss averaged."""
        # args: step's own, the optimizer first (torch's wrapper passes them whole)
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is None:
            self.first_step(optimizer)
            return self.at_step.before_step(optimizer)

        def then():  # after each call of the closure: its gradients are this step's
            self.first_step(optimizer)
            self.at_step.before_step(optimizer)
        averaged = averaging_closure(closure, then)
        if len(args) > 1:
            return (args[0], averaged, *args[2:]), kwargs
        return args, kwargs | {"closure": averaged}

    def after_step(self, optimizer, args, kwargs) -> None:
        self.first_step(optimizer)  # a closure the optimizer never called

    def first_step(self, optimizer) -> None:
        """Once per optimizer: the modules of its parameters whose forward never ran average
        their gradients at its steps; the others must have given every trainable parameter a
        gradient (unless --auto-unused)."""
        roots = self.pending.pop(optimizer, None)
        if roots is None:
            return
        from torch.distributed._composable import replicate

        mine = [self.covered[id(p)]() for g in optimizer.param_groups for p in g["params"]
                if id(p) in self.covered]
        uncalled = list({id(r): r for r in mine if r is not None
                         and not replicate.state(r).has_initialized}.values())
        if uncalled and not any(p.grad is not None for r in uncalled for p in r.parameters()):
            self.pending[optimizer] = roots  # a step before any backward: looked at next step
            return
        if uncalled:
            for root in uncalled:
                rank0_weights_now(root)  # a model moved to its GPU after its optimizer: sent now
            self.at_step.adopt(optimizer, uncalled, script_class(uncalled[0]).__name__)
        if not self.find_unused:
            for root in roots:
                if replicate.state(root).has_initialized:
                    refuse_unused(root)


def rank0_weights_now(root: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank now, when the optimizer gets them. replicate
    sends them at the first forward only: a copy the script makes in between (an EMA made after
    the optimizer, as timm's ModelEma) kept each rank's own start where the script set no seed.
    Left to that first forward where a tensor is not where the backend can send it (a model moved
    to its GPU after the optimizer was made, NCCL), or not made yet (meta)."""
    import torch.distributed as dist
    from torch.distributed.utils import _sync_module_states

    needs = "cuda" if dist.get_backend() == "nccl" else None
    tensors = [*root.parameters(), *root.buffers()]
    if any(t.is_meta or (needs and t.device.type != needs) for t in tensors):
        return
    _sync_module_states(root, dist.group.WORLD, 250 * 1024 * 1024, 0, set())  # DDP's own call


def averaging_closure(closure, then=lambda: None):
    """`closure` returning its loss averaged over the ranks. LBFGS decides on that loss (its line
    search, its stopping tests): each rank's own, from its share of the batch, made the ranks step
    differently and call the closure a different number of times, so that one waited forever in
    the gradient averaging. Averaged, every rank takes the decisions one process takes on the
    whole batch (the ranks' shares are equal: the mean of their means is the batch's mean).
    `then()`: called after each call of `closure`, before its loss is averaged."""
    import torch.distributed as dist

    @functools.wraps(closure)
    def averaged():
        loss = closure()
        then()
        is_tensor = isinstance(loss, torch.Tensor)
        if loss is None or (is_tensor and loss.numel() != 1):
            return loss
        device = loss.device if is_tensor else ("cuda" if dist.get_backend() == "nccl" else "cpu")
        total = torch.as_tensor(loss.detach() if is_tensor else float(loss), device=device,
                                dtype=torch.float64).clone()
        dist.all_reduce(total)  # a collective: every rank calls the closure alike, as above
        mean = total / dist.get_world_size()
        return mean.to(loss.dtype).reshape(loss.shape) if is_tensor else mean.item()
    return averaged


def refuse_unused(root: nn.Module) -> None:
    """At the first optimizer step: trainable parameters of a replicated module that got no
    gradient stop DDP at the next forward, in a long message; said here in one line instead."""
    model = getattr(root, "_orig_mod", root)  # torch.compile's wrapper: the script's model
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if not unused:
        return
    name = (script_class(root) if model is root else type(model)).__name__
    shown = ", ".join(unused[:4]) + (f" (+{len(unused) - 4} more)" if len(unused) > 4 else "")
    raise UsageError(f"{len(unused)} trainable parameter(s) of the {name} "
                     f"got no gradient in the first step ({shown}): --auto averages gradients as "
                     "DDP does, which needs every trainable parameter in each step's loss; freeze "
                     "what the loss does not use (requires_grad_(False)), or run with "
                     "--auto-unused (DDP then looks for unused parameters each step: slower)")


def install(env, find_unused: bool = False,
            adopt: Callable[[nn.Module], None] | None = None) -> GradientAveraging:
    registry = ModuleRegistry()
    registry.install()
    at_step = StepAveraging(env.rank, env.world_size)
    at_step.install()
    averaging = GradientAveraging(registry, at_step, find_unused, adopt)
    add_param_group = torch.optim.Optimizer.add_param_group

    @functools.wraps(add_param_group)
    def patched(self, param_group):
        add_param_group(self, param_group)
        averaging.on_param_group(self, self.param_groups[-1])

    torch.optim.Optimizer.add_param_group = patched
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(averaging.before_step)
    register_optimizer_step_post_hook(averaging.after_step)  # a closure's step, looked at after
    return averaging
