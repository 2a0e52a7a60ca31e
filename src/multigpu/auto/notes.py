"""What --auto leaves as one-process work, said once, by rank 0, when training starts.

--auto splits DataLoaders that shuffle and averages the gradients of what a torch.optim optimizer
holds. A script that trains otherwise (a hand-written `p.data.add_(-lr * p.grad)`, batches sliced
from a tensor, a `get_batch()`) runs under --auto with nothing changed: every process does the
whole job, N times the work (every process starts from rank 0's seeds, seeds.py, so each trains
the model one process trains), and rank 0's is the one printed and saved. Such a run would end
without a word, so one line says what was not split, why, and what would split it:

- no optimizer: at the first backward (torch.autograd.backward, which Tensor.backward calls, or
  torch.autograd.grad), when no torch.optim optimizer holds any parameter;
- an optimizer, but no split loader: at its first step.

At most one of the two is said. Both look for the script's optimizers and DataLoaders among the
interpreter's objects, once: nothing registers them (gradients.py finds modules the same way).
"""
from __future__ import annotations

import functools
import gc
import sys

import torch

_SLICED = "a tensor sliced in a loop, a get_batch()"
_TENSOR_FIX = "DataLoader(TensorDataset(x, y), batch_size=..., shuffle=True)"


def install(env, made: list[None]) -> None:
    """Both notes, on rank 0 (`made`: loaders.install's list, an entry per split loader)."""
    if env.rank != 0:
        return
    said: set[str] = set()
    note_no_optimizer(env, made, said)
    note_unsplit_training(env, made, said)


def note_unsplit_training(env, made: list[None], said: set[str] | None = None) -> None:
    """At the first optimizer step, rank 0 says so when no loader was split (`made` is empty):
    a script whose training loader does not shuffle, or whose batches come from no DataLoader,
    trains on all of the data in every process, N times the work for a one-process result."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    said = set() if said is None else said

    stepped = []

    # Left registered, a no-op after the first step: a hook that removes itself while torch
    # iterates over the step hooks makes the hooks registered after it fail ("OrderedDict
    # mutated during iteration").
    def first_step(optimizer, args, kwargs):
        if stepped:
            return
        stepped.append(True)
        if made or env.rank != 0 or said:
            return
        said.add("unsplit")
        print(unsplit_line(env.world_size, any_loader()), file=sys.stderr)

    register_optimizer_step_pre_hook(first_step)


def unsplit_line(world_size: int, loader_built: bool) -> str:
    work = f"the work of one process done {world_size} times"
    if loader_built:
        return (f"multigpu: note: --auto: the script's first optimizer step came before any "
                f"DataLoader with shuffle=True (or a RandomSampler): --auto splits only those, "
                f"so each of the {world_size} processes trains on the same batches, {work}; give "
                "the training DataLoader shuffle=True")
    return (f"multigpu: note: --auto: the script's first optimizer step came before any "
            f"DataLoader: batches made otherwise ({_SLICED}) are not split, so each of the "
            f"{world_size} processes trains on all of the data, {work}; --auto splits a "
            f"DataLoader with shuffle=True: read the tensors through {_TENSOR_FIX}")


def note_no_optimizer(env, made: list[None], said: set[str] | None = None) -> None:
    """At the script's first backward, rank 0 says so when no torch.optim optimizer holds a
    parameter: nothing is averaged then. torch.autograd's two entry points are wrapped until
    that first call, then given back, so later backwards run torch's own functions."""
    said = set() if said is None else said
    autograd = torch.autograd
    backward, grad = autograd.backward, autograd.grad

    def first(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if autograd.backward is wrapped_backward:
                autograd.backward = backward
            if autograd.grad is wrapped_grad:
                autograd.grad = grad
            if env.rank == 0 and not said and not any_optimizer():
                said.add("no optimizer")
                print(no_optimizer_line(env.world_size, bool(made), any_loader()), file=sys.stderr)
            return function(*args, **kwargs)
        return wrapper

    wrapped_backward, wrapped_grad = first(backward), first(grad)
    autograd.backward, autograd.grad = wrapped_backward, wrapped_grad


def no_optimizer_line(world_size: int, split: bool, loader_built: bool) -> str:
    n = world_size
    head = ("multigpu: note: --auto: the script's first backward came with no torch.optim "
            "optimizer holding its parameters: --auto averages the gradients of an optimizer's "
            "parameters only, so nothing is averaged")
    models = "(every process starts from rank 0's seeds, so each trains the same model)"
    fix = "to make it data-parallel, update the weights with a torch.optim optimizer"
    if split:
        return (f"{head}: each of the {n} processes trains a model of its own on its 1/{n} of "
                f"the split DataLoader ({n} different models), and rank 0's is the one kept "
                f"(printed, saved); {fix}")
    data = ("give the training DataLoader shuffle=True" if loader_built else
            f"read the data through {_TENSOR_FIX}: batches made otherwise ({_SLICED}) are "
            "not split")
    return (f"{head} and nothing split: each of the {n} processes trains its own copy of the "
            f"whole job, the work of one process done {n} times {models}, and rank 0's is the one "
            f"kept (printed, saved); {fix}, and {data}")


def any_optimizer() -> bool:
    """Whether a torch.optim optimizer holding any parameter exists now."""
    optimizer = torch.optim.Optimizer  # type(), not isinstance: no __class__ property runs
    return any(issubclass(type(o), optimizer) and any(g["params"] for g in o.param_groups)
               for o in gc.get_objects())


def any_loader() -> bool:
    from torch.utils.data import DataLoader

    return any(issubclass(type(o), DataLoader) for o in gc.get_objects())
