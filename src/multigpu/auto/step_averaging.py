"""Gradients averaged at the optimizer step, for a model whose forward is not called through the
module: `self.forward(x)`, or a layer's method called from outside, as forward-forward training
does (each layer with its own optimizer, trained by `layer.forward(x)`).

replicate()'s hooks, DDP's gradient averaging in buckets during backward, live in the module's
__call__; a forward called directly never runs them, and each process would step on its own
gradients. For such a module (found at its optimizer's first step: replicate never initialised
it), the gradients that its optimizer's parameters got are averaged just before each step
instead, as Horovod's DistributedOptimizer does: one all-reduce per device and dtype, after
backward and not overlapped with it, so a step is slower than under DDP. replicate's own
averaging is switched off for that module (its set_requires_gradient_sync), so that a later call
through the module (an evaluation that calls `layer(x)` with gradients on) neither averages twice
nor arms DDP for a backward that never comes.
"""
from __future__ import annotations

import functools
import sys
import weakref

import torch
from torch import nn


def average_gradients(grads: list[torch.Tensor], world_size: int) -> None:
    """Each of `grads` (the same list, in the same order, on every rank) replaced by its mean over
    the ranks: one all-reduce per (device, dtype) of the dense ones, flattened together."""
    import torch.distributed as dist

    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if g.is_sparse:  # rare (nn.Embedding(sparse=True)): its own all-reduce
            dist.all_reduce(g)
            g.div_(world_size)
        else:
            groups.setdefault((g.device, g.dtype), []).append(g)
    for same in groups.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat)
        flat.div_(world_size)
        for g, part in zip(same, flat.split([g.numel() for g in same])):
            g.copy_(part.view_as(g))


def note(name: str) -> str:
    return (f"multigpu: note: --auto: the {name}'s forward was not called through the module "
            f"(its .forward(x), or another of its methods, called directly), so its gradients are "
            f"averaged at each optimizer step (one all-reduce after backward, not overlapped with "
            f"it: slower than DDP's)")


class StepAveraging:
    """The optimizers whose steps average their gradients themselves, and which parameters."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.params: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> list
        self.unscaled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # averaged already
        self.said = False

    def adopt(self, optimizer, roots: list[nn.Module], name: str) -> None:
        """At `optimizer`'s first step: the parameters it holds of `roots` (replicated modules
        whose forward never ran) are averaged before this step and every later one."""
        held = {id(p) for r in roots for p in r.parameters()}
        self.params[optimizer] = [p for g in optimizer.param_groups for p in g["params"]
                                  if id(p) in held]
        for root in roots:
            if hasattr(root, "set_requires_gradient_sync"):  # replicate's DDP class
                root.set_requires_gradient_sync(False)
        if self.rank == 0 and not self.said:
            self.said = True
            print(note(name), file=sys.stderr, flush=True)

    def before_step(self, optimizer) -> None:
        """Each step of an adopted optimizer: its gradients averaged (a dict look-up for others),
        unless a GradScaler's unscale_ averaged them already for this step."""
        if self.unscaled.pop(optimizer, None) is None:
            self.average(optimizer)

    def average(self, optimizer) -> None:
        params = self.params.get(optimizer)
        if params is not None:
            average_gradients([p.grad for p in params if p.grad is not None], self.world_size)

    def install(self) -> None:
        """A GradScaler reads the gradients for inf/NaN in unscale_, before the step, and skips
        the step where it finds one: each rank's own, it could skip on one rank only, whose
        peers would then wait in the step's all-reduce. Averaged before unscale_, every rank
        finds the same and decides alike."""
        unscale = torch.amp.GradScaler.unscale_

        @functools.wraps(unscale)
        def unscale_(scaler, optimizer):
            if optimizer in self.params:
                self.average(optimizer)
                self.unscaled[optimizer] = True
            return unscale(scaler, optimizer)

        torch.amp.GradScaler.unscale_ = unscale_
