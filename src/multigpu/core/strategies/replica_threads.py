"""DataParallel's replica forwards on one long-lived thread per GPU, instead of new threads per step.

Why (docs/performance.md): `torch.nn.parallel.parallel_apply` starts a new thread for every replica
on every step, and per-thread state is lost with each thread:
- cuDNN's autotuning cache (`cudnn.benchmark`) is per thread, so every convolution was re-tuned on
  every step: ResNet-50 ran 25x slower on 4 GPUs than on one (4x H200, 172 img/s);
- the autocast dtype is per thread and torch passes on only "enabled", so under bf16 autocast the
  replicas ran in float16 (the thread's default dtype), without a GradScaler.
Here each GPU keeps one worker thread for the life of the process, shared by every DataParallel
model, and each call hands it the caller's grad mode, inference mode, autocast state and stream.
With cudnn.benchmark left on, 4 GPUs then ran 5,671 img/s against 4,323 for one GPU (1.31x);
2 GPUs ran 3,739 (0.86x): the replicas' forwards still take turns on the GIL.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from collections.abc import Sequence

import torch
from torch import nn

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_local = threading.local()  # .device: set on our worker threads
_names: dict[int, str] = {}  # GPU index -> the name of the thread that ran its replicas


def _pool(device: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if device not in _pools:
            _pools[device] = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix=f"multigpu-dp-cuda{device}")
        return _pools[device]


def worker_threads() -> dict[int, str]:
    """GPU index -> the name of the thread that ran its last replica (tests, diagnostics)."""
    return dict(_names)


class _CallerState:
    """What a thread does not inherit from the thread that asked it to run a replica."""

    def __init__(self):
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = torch.is_autocast_enabled("cuda")
        self.dtype = torch.get_autocast_dtype("cuda")
        self.cache = torch.is_autocast_cache_enabled()

    def run(self, device: int, stream: torch.cuda.Stream, module: nn.Module, args: Any,
            kwargs: dict) -> Any:
        _local.device = device
        _names[device] = threading.current_thread().name
        if not isinstance(args, (list, tuple)):
            args = (args,)
        with (torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad),
              torch.cuda.device(device), torch.cuda.stream(stream),
              torch.autocast("cuda", dtype=self.dtype, enabled=self.autocast,
                             cache_enabled=self.cache)):
            return module(*args, **kwargs)


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[Any],
                   kwargs: Sequence[dict] | None, devices: Sequence[int]) -> list[Any]:
    """Run replicas[i](*inputs[i], **kwargs[i]) on GPU devices[i], all at once; same contract as
    torch.nn.parallel.parallel_apply. An exception in a replica is raised here, with a note
    naming the replica and its GPU."""
    kwargs = kwargs or [{}] * len(replicas)
    if not len(replicas) == len(inputs) == len(kwargs) == len(devices):
        raise ValueError(f"{len(replicas)} replicas, {len(inputs)} inputs, {len(kwargs)} kwargs "
                         f"and {len(devices)} devices: they must be as many")
    devices = [d if isinstance(d, int) else torch.device(d).index for d in devices]
    if getattr(_local, "device", None) is not None:  # DataParallel inside a replica: no deadlock
        from torch.nn.parallel import parallel_apply as torch_parallel_apply
        return torch_parallel_apply(replicas, inputs, kwargs, devices)
    state = _CallerState()
    futures: list[Future] = [
        _pool(d).submit(state.run, d, torch.cuda.current_stream(d), m, a, k)
        for m, a, k, d in zip(replicas, inputs, kwargs, devices)]
    outputs, failure = [], None
    for i, (future, d) in enumerate(zip(futures, devices)):
        error = future.exception()  # waits; every replica finishes before anything is raised
        if error is not None and failure is None:
            error.add_note(f"(in DataParallel replica {i}, on cuda:{d})")
            failure = error
        outputs.append(None if error is not None else future.result())
    del futures, future  # they hold the exception, whose traceback holds this frame: no cycle
    if failure is not None:
        try:
            raise failure
        finally:
            del failure, error  # free the failed forward's tensors now, not at the next gc
    return outputs
