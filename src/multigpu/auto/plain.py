"""A module that --auto replicated, as the script's plain module: what pickle writes
(torch.save of a whole model) and what copy.deepcopy makes (an EMA copy, a snapshot of the best
model), as in a one-device run: an instance of the script's own class with its parameters,
buffers and submodules, without replicate's state (a process group, a Reducer) and hooks.
replicate() makes the module's class a DDP<cls> that pickle cannot find by name, and whose
__deepcopy__ refuses ("DDP does not support deepcopy").
"""
from __future__ import annotations

import collections
import copy

from torch import nn


def script_class(module: nn.Module) -> type:
    """The script's own class of a replicated module: replicate() makes the module's class a
    DDP<cls> whose bases are (replicate's DDP, cls)."""
    return type(module).__mro__[2]


def replicated_parts(module: nn.Module):
    """The state that replicate() added to `module` (its keys in the module's __dict__, and the
    hooks it registered), or None for a module that was not replicated."""
    try:  # private names (docs/torch-api.md): without them, pickle fails as it would before
        from torch.distributed._composable import replicate
        from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
        from torch.distributed._composable.replicate import DDP
    except ImportError:
        return None
    if not isinstance(module, DDP):
        return None
    state = replicate.state(module)
    return (STATE_KEY, REGISTRY_KEY), state


def plain_reduction(module: nn.Module, parts) -> tuple:
    """How pickle writes a replicated module: as the class under replicate's DDP<cls>, without
    replicate's state and hooks."""
    keys, state = parts
    dump = {k: v for k, v in module.__getstate__().items() if k not in keys}
    for hooks, flags in (("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"),
                         ("_forward_hooks", "_forward_hooks_with_kwargs")):
        dropped = {i for i, h in dump[hooks].items() if getattr(h, "__self__", None) is state}
        dump[hooks] = collections.OrderedDict(
            (i, h) for i, h in dump[hooks].items() if i not in dropped)
        # an OrderedDict, as torch's: a hook's RemovableHandle holds a weak reference to it
        dump[flags] = collections.OrderedDict(
            (i, v) for i, v in dump.get(flags, {}).items() if i not in dropped)
    # object.__new__(cls), not copyreg.__newobj__: pickle checks that one's class is type(module)
    return object.__new__, (script_class(module),), dump


def plain_deepcopy(module: nn.Module, memo: dict) -> nn.Module:
    """copy.deepcopy of a replicated module (its class's __deepcopy__): a plain module of the
    script's class, not replicated; its gradients are not averaged (an EMA copy has none)."""
    _, (cls,), state = plain_reduction(module, replicated_parts(module))
    twin = object.__new__(cls)
    memo[id(module)] = twin
    twin.__setstate__(copy.deepcopy(state, memo))
    return twin
