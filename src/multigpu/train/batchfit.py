"""The largest batch that fits: real steps of growing size until one runs out of memory.

Used by `multigpu doctor` (the batch that fits, trap 2) and by `--batch-size auto`, where every
rank searches on its own GPU and the ranks then take the smallest answer (no rank may train with
another size: the steps would differ and DDP would wait forever).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from collections.abc import Callable

import torch

DEFAULT_LIMIT = 4096  # per-GPU samples; larger batches are not searched
HEADROOM = 0.9        # a size fits when its peak stays under this share of the GPU's memory:
                      # evaluation, checkpoints and fragmentation over a long run need the rest


@dataclass(frozen=True)
class Fit:
    largest: int | None  # the largest size that fitted; None when not even the first did
    peak: int            # its peak bytes
    failed: int | None   # the smallest size that did not fit; None when the limit was reached


def largest_batch(try_size: Callable[[int], int], *, start: int, limit: int,
                  budget: float | None = None) -> Fit:
    """Doubling from `start` up to `limit`, then halving the gap between the last size that fit
    and the first that did not, down to about 1/16 of it. `try_size(n)` runs one real step of n
    samples and returns its peak bytes; an out-of-memory error, or a peak over `budget`, means
    n does not fit."""
    ok, peak, bad = None, 0, None
    size = max(1, min(start, limit))
    while True:
        used = _fits(try_size, size, budget)
        if used is None:
            bad = size
            break
        ok, peak = size, used
        if size >= limit:
            break
        size = min(size * 2, limit)
    low = ok or 0
    while bad is not None and bad - low > max(1, low // 16):
        mid = (low + bad) // 2
        if mid == low:
            break
        used = _fits(try_size, mid, budget)
        if used is None:
            bad = mid
        else:
            ok, peak, low = mid, used, mid
    return Fit(ok, peak, bad)


def repeat_to(t: torch.Tensor, n: int) -> torch.Tensor:
    """`n` samples made of `t`'s, repeated: a batch of any size for a memory test, where the
    values do not matter."""
    return t.repeat(-(-n // t.shape[0]), *[1] * (t.dim() - 1))[:n]


def _fits(try_size: Callable[[int], int], size: int, budget: float | None) -> int | None:
    try:
        used = try_size(size)
    except torch.OutOfMemoryError:
        used = None
    except RuntimeError as exc:  # cuBLAS / cuDNN allocation failures say it in words
        if "out of memory" not in str(exc).lower() and "ALLOC_FAILED" not in str(exc):
            raise
        used = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if used is None or (budget is not None and used > budget):
        return None
    return used


# --------------------------------------------------------------------------- --batch-size auto

AUTO = "auto"
_SAMPLES = 64  # real samples the search's batches are made of (repeated: values do not matter)


def auto_batch_size(cfg, rt, previous: int | None) -> int:
    """--batch-size auto inside `multigpu train`'s workers: the largest per-GPU batch that fits on
    every rank's GPU, or `previous`, the size the run already trains with (rank 0's word: a
    resumed run keeps its batch, so its steps stay those of the run it continues). Collective."""
    from multigpu.core import console
    from multigpu.core.errors import UsageError

    previous = rt.env.broadcast_object(previous)
    if previous:
        console.info(f"--batch-size auto: {previous} per GPU, the size this run has trained with")
        return int(previous)
    mine, peak = _search_on_this_gpu(cfg, rt)
    gc.collect()  # the search's model and optimizer, gone with its frame
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(rt.device)  # the run's own peak from here, not the search's
    agreed = int(rt.env.all_reduce(torch.tensor(mine, device=rt.device), "min").item())
    total = torch.cuda.get_device_properties(rt.device).total_memory
    if agreed < 1:
        raise UsageError(f"--batch-size auto: not even one sample per step fits on a GPU of this "
                         f"run ({rt.device} has {total / 2**30:.0f} GiB): use --precision bf16, "
                         "a smaller model or --image-size")
    console.info(f"--batch-size auto: {agreed} per GPU, the largest that fits on every GPU of the "
                 f"run with {1 - HEADROOM:.0%} of its memory kept free (rank 0: {mine}, peak "
                 f"{peak / 2**30:.1f} of {total / 2**30:.0f} GiB)")
    return agreed


def _search_on_this_gpu(cfg, rt) -> tuple[int, int]:
    """(size, peak bytes) on this rank's GPU, with a bare model: no DDP, no collective, so that
    ranks that stop at different sizes cannot wait for each other. DDP's gradient buckets, about
    the gradients' size, are kept out of the budget."""
    from multigpu.train.engine import StepSettings, prepare_inputs
    from multigpu.train.models.catalog import build_model
    from multigpu.train.training import load_run_data, make_optimizer

    data = load_run_data(cfg)
    model = build_model(cfg.model, data.input_shape, data.num_outputs).to(rt.device)
    optimizer = make_optimizer(cfg, model)
    settings = StepSettings.for_data(data.normalize, rt.device)
    loss_fn = (torch.nn.functional.cross_entropy if data.task == "classification"
               else torch.nn.functional.mse_loss)
    xs, ys = torch.utils.data.default_collate([data.train[i] for i in range(min(_SAMPLES, len(data.train)))])

    def try_size(n: int) -> int:
        x, y = repeat_to(xs, n).to(rt.device), repeat_to(ys, n).to(rt.device)
        torch.cuda.reset_peak_memory_stats(rt.device)
        try:
            with rt.autocast():
                out = model(prepare_inputs(x, settings))
            loss_fn(out.float(), y).backward()
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(rt.device)
        return torch.cuda.max_memory_allocated(rt.device)

    total = torch.cuda.get_device_properties(rt.device).total_memory
    buckets = sum(p.numel() * p.element_size() for p in model.parameters()) if rt.world_size > 1 else 0
    devices = rt.world_size * rt.strategy.devices_per_process
    limit = max(1, min(DEFAULT_LIMIT, len(data.train) // devices))
    fit = largest_batch(try_size, start=min(32, limit), limit=limit, budget=HEADROOM * total - buckets)
    return fit.largest or 0, fit.peak
