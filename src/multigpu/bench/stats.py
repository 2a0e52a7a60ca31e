"""The arithmetic of a benchmark row: throughput statistics, scaling efficiency, FLOPs and MFU.

Pure functions, no GPU: the parent computes FLOPs on the meta device (shapes only, no memory, no
CUDA context that would take memory on GPU 0 before the workers start).
"""
from __future__ import annotations

import statistics

# Dense bf16/fp16 tensor-core peak per GPU, FLOP/s, from the vendors' data sheets (SXM parts).
# Matched by substring of the CUDA/NVML name; the PCIe and NVL variants of H100/H200 have lower
# clocks and power, so they are left unknown rather than guessed.
PEAK_FLOPS_16BIT = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12))
_LOWER_POWER_VARIANTS = ("PCIE", "NVL")


def trial_stats(trial_seconds: list[float], samples_per_trial: list[int], steps: int) -> dict:
    """Median and spread (min, max) over trials of global samples/s and of step time in ms."""
    if not trial_seconds or len(trial_seconds) != len(samples_per_trial):
        raise ValueError("need one sample count per timed trial")
    rates = [n / t for n, t in zip(samples_per_trial, trial_seconds)]
    step_ms = [1000.0 * t / steps for t in trial_seconds]
    median = statistics.median(rates)
    return {
        "img_per_s": median,
        "img_per_s_min": min(rates),
        "img_per_s_max": max(rates),
        "spread_pct": 100.0 * (max(rates) - min(rates)) / median if median else None,
        "step_ms": statistics.median(step_ms),
        "step_ms_min": min(step_ms),
        "step_ms_max": max(step_ms),
    }


def scaling_efficiency(throughput: float, gpus: int, single_throughput: float | None) -> float | None:
    """throughput / (gpus x one-GPU throughput): 1.0 is perfect linear scaling."""
    if not single_throughput or gpus < 1:
        return None
    return throughput / (gpus * single_throughput)


def peak_flops(gpu_name: str | None, precision: str) -> float | None:
    """Dense 16-bit peak of one GPU, or None when the GPU or the precision has no entry.

    fp32 runs (TF32 or not) get None: comparing them to the 16-bit peak would mislead.
    """
    if not gpu_name or precision not in ("bf16", "fp16"):
        return None
    name = gpu_name.upper()
    for key, flops in PEAK_FLOPS_16BIT:
        if key in name:
            if key in ("H100", "H200") and any(v in name for v in _LOWER_POWER_VARIANTS):
                return None
            return flops
    return None


def mfu(flops_per_step_per_gpu: float | None, step_seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: useful FLOPs per second on one GPU over its peak."""
    if not flops_per_step_per_gpu or not peak or step_seconds <= 0:
        return None
    return flops_per_step_per_gpu / step_seconds / peak


def train_step_flops(model_name: str, input_shape: tuple[int, ...], num_outputs: int,
                     batch: int) -> int | None:
    """FLOPs of one forward + backward of `batch` samples, counted once on the meta device.

    FlopCounterMode counts matrix multiplies and convolutions (2 FLOPs per multiply-add), the
    convention MFU uses; element-wise work (BatchNorm, activations) and the optimizer are left out.
    None when the model cannot run on meta tensors.
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from multigpu.train.models.catalog import build_model

    try:
        with torch.device("meta"):
            model = build_model(model_name, input_shape, num_outputs)
        x = torch.empty((batch, *input_shape), device="meta")
        y = torch.zeros((batch,), dtype=torch.int64, device="meta")
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(model(x).float(), y).backward()
        return int(counter.get_total_flops()) or None
    except Exception:  # external models may need real data; MFU is then left out
        return None
