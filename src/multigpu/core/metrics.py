"""Exact metrics across ranks.

Every rank adds sums and counts of its real samples on its own device (no host-device sync in the
loop), and one all-reduce at the end adds them up. Because the prepared loaders never pad, each
validation sample is counted exactly once, so the accuracy of a 2-GPU run equals that of a 1-GPU run.
"""
from __future__ import annotations

import torch

from multigpu.core.distributed import DistEnv


class Sums:
    """Named running sums, reduced over all ranks with a single all-reduce.

    env:    the DistEnv (`rt.env`).
    device: where the sums live (default: env.device), so adding device tensors never waits
            for the GPU.

        sums = Sums(rt.env)
        for x, y in val_loader:
            loss = loss_fn(model(x), y)
            sums.add(loss_sum=loss * len(y), samples=len(y))
        totals = sums.reduce()          # {"loss_sum": ..., "samples": ...} over all ranks
        mean_loss = totals["loss_sum"] / totals["samples"]
    """

    def __init__(self, env: DistEnv, device: torch.device | None = None):
        self.env = env
        self.device = device or env.device
        self._values: dict[str, torch.Tensor] = {}

    def add(self, **values) -> None:
        """Add to the named sums: numbers, or tensors (summed over their elements, detached)."""
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().to(self.device, torch.float64).sum()
            current = self._values.get(name)
            if current is None:
                self._values[name] = torch.as_tensor(value, dtype=torch.float64, device=self.device).clone()
            else:
                current += value

    def reduce(self) -> dict[str, float]:
        """Totals over all ranks (a collective: every rank must call it, with the same names)."""
        names = sorted(self._values)
        if not names:
            return {}
        stacked = torch.stack([self._values[n] for n in names])
        self.env.all_reduce(stacked)
        return dict(zip(names, stacked.tolist()))

    def reset(self) -> None:
        """Forget every sum, to start the next epoch."""
        self._values.clear()


def correct_count(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """How many predictions (argmax over the last dim) equal the targets, as a device tensor."""
    return (logits.argmax(dim=-1) == target).sum()


class MeanMetric:
    """A mean over samples across ranks: `update(batch_mean, n)`, then `compute()`.

    Exact when ranks hold different numbers of samples (each batch mean is weighted by its n):

        val_loss = MeanMetric(rt.env)
        for x, y in val_loader:
            val_loss.update(loss_fn(model(x), y), len(y))
        rt.print(f"val loss {val_loss.compute():.4f}")   # collective: call it on every rank
    """

    def __init__(self, env: DistEnv):
        self._sums = Sums(env)

    def update(self, value: torch.Tensor | float, n: int) -> None:
        """Add a mean `value` (a number or a 0-d tensor) over `n` samples."""
        self._sums.add(total=value * n if not isinstance(value, torch.Tensor) else value.detach() * n,
                       count=n)

    def compute(self) -> float:
        """The mean over every sample of every rank (NaN when none). Collective: every rank
        calls it."""
        t = self._sums.reduce()
        return t["total"] / t["count"] if t.get("count") else float("nan")

    def reset(self) -> None:
        """Start again from no samples."""
        self._sums.reset()


class Accuracy:
    """Classification accuracy across ranks: `update(logits, target)`, then `compute()`.

    Each sample counts once over all ranks (the prepared loaders never pad), so N processes
    report the accuracy that one process would:

        accuracy = Accuracy(rt.env)
        with torch.no_grad():
            for x, y in val_loader:
                accuracy.update(model(x), y)
        rt.print(f"accuracy {accuracy.compute():.2%}")
    """

    def __init__(self, env: DistEnv):
        self._sums = Sums(env)

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Count the predictions (argmax over the last dimension of `logits`) equal to `target`."""
        self._sums.add(correct=correct_count(logits, target), count=target.numel())

    def compute(self) -> float:
        """The fraction correct (0..1) over every sample of every rank (NaN when none).
        Collective: every rank calls it."""
        t = self._sums.reduce()
        return t["correct"] / t["count"] if t.get("count") else float("nan")

    def reset(self) -> None:
        """Start again from no samples."""
        self._sums.reset()


def reduce_tensor(env: DistEnv, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
    """A copy of `tensor` summed (op="sum") or averaged (op="mean") over ranks, for display.

    This is post 002's `reduce_tensor`. For a mean over samples when ranks hold different numbers
    of samples, use `MeanMetric` instead: a plain average of per-rank means is then off.
    Collective: every rank calls it. Returns a new tensor; `tensor` is left as it is.

        rt.print(f"loss {multigpu.reduce_tensor(rt.env, loss).item():.4f}")
    """
    out = tensor.detach().clone()
    env.all_reduce(out, "sum")
    return out / env.world_size if op == "mean" else out
