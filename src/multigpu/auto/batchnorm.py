"""BatchNorm over the global batch, in the global-batch mode.

One process normalizes each BatchNorm's input over the script's whole batch. Split over N
processes, each would normalize its own batch_size / N samples, as under DDP, and a model whose
training leans on its batch statistics trains differently: a GAN's discriminator, a small batch
(the DCGAN of docs/launching.md's corpus ended outside its one-process range so). torch's
SyncBatchNorm computes them over every process, but on GPUs only, and as a module class of its
own, which would then be what the script saves.

So the modules stay the script's own. torch.nn.functional.batch_norm, which every BatchNorm's
forward calls, is wrapped: for a BatchNorm inside a module whose gradients --auto averages (known
by its weight or its running mean, so a copy the script makes, an EMA, stays plain), in training,
each process puts its count, mean and centred sum of squares per channel in its own slot of one
all-reduce; each combines the slots exactly (the pairwise formula of Chan et al.) into the mean
and variance of the global batch, normalizes its share with them, and updates the running
statistics as one process does (every process the same ones). The all-reduce is part of autograd
(its backward all-reduces the gradient), so backward sends the statistics' gradients across as
torch's SyncBatchNorm does; DDP's averaging then gives one process's gradient on the global batch.
The cost: one small all-reduce per BatchNorm call in forward, one in backward, and a graph break
under torch.compile.

A BatchNorm with neither affine weights nor running statistics cannot be told apart, and stays
each process's own.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# the Lazy ones become the others at their first forward, as the same objects
BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
              nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)


class _SumOverProcesses(torch.autograd.Function):
    """all_reduce(SUM) of a tensor, in autograd: the gradient of each process's copy of the sum
    is every process's gradient of it, summed the same way."""

    @staticmethod
    def forward(ctx, tensor):
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total)
        return total


class GlobalBatchNorm:
    """The BatchNorms whose statistics are over every process: those of the replicated modules."""

    def __init__(self):
        self._by_weight: dict[int, weakref.ref] = {}
        self._unweighted: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def adopt(self, root: nn.Module) -> None:
        """`root` is replicated: its BatchNorms normalize over the global batch from now on."""
        for m in root.modules():
            if not isinstance(m, BATCHNORMS):
                continue
            if m.weight is not None:
                self._by_weight[id(m.weight)] = weakref.ref(m)
            else:
                self._unweighted.add(m)

    def adopted(self, weight, running_mean) -> bool:
        """Whether a batch_norm call with these tensors is one of the adopted modules'."""
        if weight is not None:
            ref = self._by_weight.get(id(weight))
            module = ref() if ref is not None else None
            return module is not None and module.weight is weight
        return running_mean is not None and any(m.running_mean is running_mean
                                                for m in self._unweighted)

    def install(self) -> None:
        plain = F.batch_norm

        # run eagerly, between compiled graphs: under torch.compile the tensors are fakes, whose
        # ids say nothing, and a BatchNorm normalized its own share (ranks 0.4 apart after 12
        # steps of tests/multiproc/scripts/auto_batchnorm.py compiled)
        @torch.compiler.disable
        @functools.wraps(plain)
        def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
                       momentum=0.1, eps=1e-5):
            if training and self.adopted(weight, running_mean):
                return global_batch_norm(input, running_mean, running_var, weight, bias,
                                         momentum, eps)
            return plain(input, running_mean, running_var, weight, bias, training, momentum, eps)

        F.batch_norm = batch_norm


def global_batch_norm(x: torch.Tensor, running_mean, running_var, weight, bias, momentum: float,
                      eps: float) -> torch.Tensor:
    """F.batch_norm in training, with the statistics of every process's `x` together."""
    c = x.shape[1]
    dims = [d for d in range(x.dim()) if d != 1]
    shape = [1, c] + [1] * (x.dim() - 2)
    xf = x.float()  # the statistics in float32, as torch's kernels keep them for half inputs
    n = x.numel() // c if c else 0  # this process's values per channel
    mean = xf.mean(dims) if n else xf.new_zeros(c)
    m2 = (xf - mean.view(shape)).pow(2).sum(dims)
    mine = torch.cat([xf.new_full((1,), float(n)), mean, m2])
    world, rank = dist.get_world_size(), dist.get_rank()
    slots = torch.cat([mine.new_zeros(rank, mine.numel()), mine[None],
                       mine.new_zeros(world - rank - 1, mine.numel())])
    slots = _SumOverProcesses.apply(slots)
    counts, means, m2s = slots[:, :1], slots[:, 1:c + 1], slots[:, c + 1:]
    total = counts.sum()
    g_mean = (counts * means).sum(0) / total
    g_m2 = (m2s + counts * (means - g_mean).pow(2)).sum(0)
    y = (xf - g_mean.view(shape)) * torch.rsqrt(g_m2 / total + eps).view(shape)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    with torch.no_grad():  # as one process: the running variance unbiased
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = g_m2 / (total - 1).clamp(min=1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return y.to(x.dtype)


def install() -> GlobalBatchNorm:
    norms = GlobalBatchNorm()
    norms.install()
    return norms
