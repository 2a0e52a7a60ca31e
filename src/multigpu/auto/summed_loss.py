"""A loss summed over the batch keeps one process's gradient in the global-batch mode.

DDP averages the processes' gradients. For a loss that is a mean over the batch, the mean of the
N processes' means is the mean over the global batch: the one-process gradient, and the script's
learning rate stays right. A sum (`reduction='sum'`, as VAE examples use) is not: each process
sums its batch_size / N samples, and the average of those sums' gradients is 1/N of the gradient
of the sum over the global batch, which with plain SGD is a learning rate N times smaller.

Where the loss is one of torch's, called with reduction='sum' (torch.nn.functional's losses, and
so the nn.*Loss modules, which call them), that is known: while the script trains on a split
DataLoader (training_reads.py), such a loss returns its value times N, so that the averaged
gradient is that of the global sum, and the loss the script prints is on that scale (the sum over
the global batch, about N times the process's own). Said once, on rank 0. A loss evaluated with
gradients off, or on a loader left whole (every process has the one-process batch), is left as
it is.

A sum written by hand (`(x - y).pow(2).sum()`, a VAE's KL term `torch.sum(...)`) cannot be told
from any other sum in general; at the first backward of a split pass, the loss's graph is read
for a full sum over a tensor whose first dimension is the process's batch, through its + - * /
terms (a sum divided by that batch size is a mean, left alone). Where one is seen, rank 0 says in
one line that its gradient is 1/N of one process's, and the fix.
"""
from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.nn.functional as F

from multigpu.auto.first_step import library_folders, script_line

# the autograd nodes a loss's terms are combined by (+ - * / and negation), read through
_TERMS = {"AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "RsubBackward0",
          "RsubBackward1", "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1",
          "NegBackward0"}


def torch_losses() -> dict[str, object]:
    """torch.nn.functional's functions that take `reduction`, by name."""
    found = {}
    for name in dir(F):
        fn = getattr(F, name)
        if name.startswith("_") or not callable(fn):
            continue
        try:
            if "reduction" in inspect.signature(fn).parameters:
                found[name] = fn
        except (TypeError, ValueError):
            continue
    return found


def reduction_reader(fn):
    """A function (args, kwargs) -> the reduction a call of the loss `fn` asks for, including
    the legacy size_average=False / reduce=False, read without binding the whole signature."""
    params = inspect.signature(fn).parameters
    at = {n: i for i, (n, p) in enumerate(params.items())
          if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}
    default = params["reduction"].default

    def get(args, kwargs, name):
        if name in kwargs:
            return kwargs[name]
        i = at.get(name)
        return args[i] if i is not None and i < len(args) else None

    def read(args, kwargs) -> str:
        size_average, reduce = get(args, kwargs, "size_average"), get(args, kwargs, "reduce")
        if size_average is not None or reduce is not None:  # torch's legacy_get_string
            return "none" if reduce is False else ("sum" if size_average is False else "mean")
        return get(args, kwargs, "reduction") or default
    return read


def summed_over(node, batch: int, depth: int = 0) -> bool:
    """Whether the autograd graph from `node` (a loss's grad_fn) holds, through its + - * / terms,
    a full sum over a tensor whose first dimension is `batch`."""
    if node is None or depth > 12:
        return False
    name = node.name()
    if name == "SumBackward0":
        sizes = tuple(getattr(node, "_saved_self_sym_sizes", ()))  # private: docs/torch-api.md
        return bool(sizes) and int(sizes[0]) == batch
    if name not in _TERMS:
        return False
    if name.startswith("Div") and _is_number(getattr(node, "_saved_other", None), batch):
        return False  # a sum over the batch divided by its size: a mean written by hand
    return any(summed_over(child, batch, depth + 1) for child, _ in node.next_functions)


def _is_number(value, number: int) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and float(value) == number
    return isinstance(value, (int, float)) and value == number


def scaled_note(name: str, where: str | None, per: int, world: int) -> str:
    at = f" ({where})" if where else ""
    return (f"multigpu: note: --auto: the script's loss F.{name}(reduction='sum'){at} sums over "
            f"the {per} samples of each process: --auto multiplies it by {world} (the processes) "
            f"while training, so that its gradient, averaged over them, is one process's on the "
            f"global batch of {per * world}, and the loss printed is on that scale (the sum over "
            "the global batch)")


def hand_sum_note(where: str | None, per: int, world: int) -> str:
    at = f" at {where}" if where else ""
    return (f"multigpu: note: --auto: the loss given to backward{at} holds a sum over the batch "
            f"that is no torch loss (a .sum() over the {per} samples of each process): averaged "
            f"over the {world} processes, its gradient is 1/{world} of one process's on the "
            f"global batch of {per * world}; take the mean over the batch instead, or run with "
            f"--auto-batch per-gpu ({per * world} samples per process, summed as one process "
            f"does: a global batch of {per * world * world} at the script's learning rate, "
            f"{world}x fewer steps per epoch)")


class SummedLoss:
    def __init__(self, reads, rank: int):
        self.reads, self.rank, self.world_size = reads, rank, reads.world_size
        self.depth = 0  # a torch loss that calls another is scaled once, outermost
        self.said: set[str] = set()
        self.ours = library_folders()

    def wrap(self, name: str, fn):
        read = reduction_reader(fn)

        @functools.wraps(fn)
        def loss(*args, **kwargs):
            if self.depth or self.reads.split_batch is None or not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            self.depth += 1
            try:
                value = fn(*args, **kwargs)
            finally:
                self.depth -= 1
            if read(args, kwargs) != "sum":
                return value
            self.say("scaled", lambda: scaled_note(name, script_line(sys._getframe(1), self.ours),
                                                   self.reads.split_batch, self.world_size))
            return value * self.world_size
        return loss

    def say(self, what: str, line) -> None:
        if self.rank == 0 and what not in self.said:
            self.said.add(what)
            print(line(), file=sys.stderr, flush=True)

    def first_backward(self, loss: torch.Tensor) -> None:
        batch = self.reads.split_batch
        if batch is not None and summed_over(loss.grad_fn, batch):
            self.say("by hand", lambda: hand_sum_note(script_line(sys._getframe(1), self.ours),
                                                      batch, self.world_size))


def install(reads, rank: int) -> SummedLoss:
    """In global-batch mode with more than one process: torch's losses scaled as above, and the
    first backward of a split pass looked at (then torch's backward is given back)."""
    summed = SummedLoss(reads, rank)
    for name, fn in torch_losses().items():
        setattr(F, name, summed.wrap(name, fn))
    original, looked = torch.Tensor.backward, []

    @functools.wraps(original)
    def backward(self, *args, **kwargs):
        if not looked and reads.split_batch is not None:
            looked.append(True)
            if torch.Tensor.backward is backward:  # not wrapped again since: give it back
                torch.Tensor.backward = original
            summed.first_backward(self)
        return original(self, *args, **kwargs)

    torch.Tensor.backward = backward
    return summed
