"""A replicated module traced (torch.jit.trace, tensorboard's add_graph, torch.export.export)
as the script's plain module, as in a one-device run.

replicate()'s forward pre-hook builds DDP's Reducer at the module's first forward and runs DDP's
pre-forward at each one: under torch.jit.trace the first fails (`unsupported input list type:
Tensor[]`, DDP's check of the parameters' shapes across the processes), a later one too (the
process group "is not part of the active trace"), and torch.export stops on the Reducer's
buffers. A tracer needs only the module's graph and its weights at that moment: it is given a
twin of the module of the script's own class, sharing its parameters, buffers and submodules,
without replicate's state and hooks (and a module holding a replicated one, a twin holding the
twin). The script's module is left as it is: replicated, its first real forward builds the
Reducer, and the traced module's weights are the model's own tensors, trained with it.

A function traced (torch.jit.trace(lambda x: model(x), x)) is not looked into: the replicated
module it calls runs its hooks inside the trace as before. torch.onnx.export (dynamo=True, torch's
default) captures its graph with torch.export.export, so it is covered; its older TorchScript path
(dynamo=False) traces with a private torch.jit function and is not (torch.onnx is not imported
here: it costs every run's start, and the onnx package is not here to try it).
"""
from __future__ import annotations

import functools

from torch import nn

from multigpu.auto.plain import plain_reduction, replicated_parts


def plain_view(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """`module` itself where no replicated module is in it; else a shallow twin of its class (the
    script's class of a replicated one), its replicated submodules twins too."""
    memo = {} if memo is None else memo
    if id(module) in memo:  # a submodule met twice (shared layers): one twin, as in the model
        return memo[id(module)]
    if not any(replicated_parts(m) is not None for m in module.modules()):
        return module
    parts = replicated_parts(module)
    if parts is None:
        cls, state = type(module), dict(module.__dict__)
    else:
        _, (cls,), state = plain_reduction(module, parts)
    twin = object.__new__(cls)
    memo[id(module)] = twin
    # the same parameter and buffer dicts: the traced module's weights are the model's own
    state["_modules"] = type(module._modules)(
        (name, None if child is None else plain_view(child, memo))
        for name, child in module._modules.items())
    twin.__setstate__(state)
    return twin


def _plain(obj):
    """What a tracer is given in place of `obj`: a module's plain view, a module's bound method
    (`torch.jit.trace(model.forward, x)`) the view's, anything else as it is."""
    if isinstance(obj, nn.Module):
        return plain_view(obj)
    owner = getattr(obj, "__self__", None)
    view = plain_view(owner) if isinstance(owner, nn.Module) else owner
    return obj if view is owner else getattr(view, obj.__name__)


def _plain_first(fn, name: str):
    """`fn` given the plain view of its first argument, `name` (the module or function traced)."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        if args:
            args = (_plain(args[0]), *args[1:])
        elif name in kwargs:
            kwargs[name] = _plain(kwargs[name])
        return fn(*args, **kwargs)
    traced.__wrapped_by_multigpu__ = True
    return traced


def install() -> None:
    # torch's public names, looked up when called (tensorboard's add_graph calls torch.jit.trace,
    # torch.onnx.export torch.export.export); torch.jit.trace calls trace_module given the view
    import torch.export

    for owner, name, first in ((torch.jit, "trace", "func"), (torch.jit, "trace_module", "mod"),
                               (torch.export, "export", "mod")):
        fn = getattr(owner, name, None)
        if fn is not None and not getattr(fn, "__wrapped_by_multigpu__", False):
            setattr(owner, name, _plain_first(fn, first))
