"""torch.nn.DataParallel over chosen GPU ids, kept for fidelity with the posts.

What this module makes impossible or loud (the trap numbers of docs/traps.md):
- trap 1: the model is moved to the first GPU *before* it is wrapped, always;
- trap 3: the prepared loader never yields a batch smaller than the number of GPUs;
- trap 10: calling a custom method (`model.my_forward(x)`) or going through `model.module`
  bypasses the scatter and runs on one GPU: the first is a clear error, the second a warning;
- trap 11: a per-sample list passed to forward is copied whole to every GPU, not split: warning;
- trap 5: torch starts new replica threads every step, which loses cuDNN's per-thread tuning
  cache (25x slower with cudnn.benchmark) and the bf16 autocast dtype (replicas ran in fp16):
  replicas run on one long-lived thread per GPU instead (replica_threads.py).
DataParallel is one process driving several GPUs; DDP is faster (see docs/performance.md).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from multigpu.core.distributed import DistEnv
from multigpu.core.errors import Api, Text, UsageError
from multigpu.core.strategies import replica_threads
from multigpu.core.strategies.base import Strategy


class DataParallel(Strategy):
    name = "dp"

    def __init__(self, env: DistEnv, device_ids: tuple[int, ...]):
        super().__init__(env)
        if env.is_distributed:
            raise UsageError(Text(
                "strategy 'dp' runs in one process that drives several GPUs, but this process is "
                f"one of {env.world_size} launched ones; use {{}} with a launcher, or {{}} without "
                "one", Api("setup.strategy", "ddp"), Api("setup.strategy", "dp")))
        if not device_ids:
            raise UsageError(Text("strategy 'dp' needs GPUs; on CPU use {} or {} with {}",
                                  Api("setup.strategy", "single"), Api("setup.strategy", "ddp"),
                                  Api("launch.devices", "cpu:N",
                                      text="`multigpu run --devices cpu:N`")))
        self.device_ids = tuple(int(i) for i in device_ids)

    @classmethod
    def create(cls, env: DistEnv, *, device_ids: tuple[int, ...] = (),
               options: object | None = None) -> DataParallel:
        if env.device.type != "cuda":
            device_ids = ()  # refused by __init__, with the fix
        elif not device_ids:  # default: every visible GPU
            device_ids = tuple(range(torch.cuda.device_count()))
        return cls(env, device_ids)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_ids[0])

    @property
    def devices(self) -> list[torch.device]:
        return [torch.device("cuda", i) for i in self.device_ids]

    def setup_module(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)  # trap 1: weights in place on device_ids[0] first
        if len(self.device_ids) == 1:
            return model
        _warn_on_scatter_bypass(model)
        warnings.warn(f"strategy 'dp' drives {len(self.device_ids)} GPUs from one process: it "
                      "copies the model to every GPU each step and runs the replicas' forwards on "
                      "threads that share the GIL. Measured on 4x H200 (ResNet-50 bf16, batch 128 "
                      "per GPU): 0.86x the speed of ONE GPU on 2 GPUs and 1.31x on 4, against "
                      "0.85 x 2 and 0.90 x 4 for ddp in the same run. Use strategy 'ddp' (the "
                      "default with several GPUs)", stacklevel=3)
        return CheckedDataParallel(model, device_ids=list(self.device_ids))

    def describe(self) -> str:
        return f"dp (GPUs {','.join(map(str, self.device_ids))})"


class CheckedDataParallel(nn.DataParallel):
    """nn.DataParallel that explains the two ways users lose its parallelism."""

    _warned_list_arg = False

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = super().__getattr__("module")
            if hasattr(inner, name):
                raise AttributeError(
                    f"'{name}' belongs to your model, not to DataParallel: only model(x) splits "
                    f"the batch over the GPUs. Move that code into forward(), or call "
                    f"model.module.{name}(...) knowing it runs on one GPU") from None
            raise

    def forward(self, *inputs, **kwargs):
        if not self._warned_list_arg:
            self._check_per_sample_lists(inputs, kwargs)
        return super().forward(*inputs, **kwargs)

    def parallel_apply(self, replicas, inputs, kwargs):
        # One long-lived thread per GPU: cuDNN's tuning cache and the autocast dtype survive
        # (torch starts new threads every step; see replica_threads.py).
        return replica_threads.parallel_apply(replicas, inputs, kwargs,
                                              self.device_ids[:len(replicas)])

    def _check_per_sample_lists(self, inputs, kwargs) -> None:
        batch = next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim()), None)
        if batch is None or batch < 2:
            return
        args = list(enumerate(inputs)) + list(kwargs.items())
        for key, value in args:
            if (isinstance(value, (list, tuple)) and len(value) == batch
                    and not any(isinstance(v, torch.Tensor) for v in value)):
                type(self)._warned_list_arg = True
                where = f"argument {key}" if isinstance(key, str) else f"positional argument {key}"
                warnings.warn(f"{where} of forward() is a list of {batch} items, one per sample, "
                              "but DataParallel copies non-tensor arguments whole to every GPU "
                              "instead of splitting them; pass a tensor", stacklevel=3)
                return


def _warn_on_scatter_bypass(model: nn.Module) -> None:
    """Warn once if the *original* module's children run while DataParallel is in use.

    DataParallel runs replicas (new objects) on every GPU, including the first; the original
    children only run when the wrapper is bypassed, e.g. `model.module.my_forward(x)`.
    """
    def hook(child, _args):
        if child is originals.get(id(child)) and child.training and torch.is_grad_enabled():
            warnings.warn("the model ran outside DataParallel (through model.module or a custom "
                          "method), so the batch was not split and only one GPU worked; "
                          "call model(x)", stacklevel=2)
            for h in handles:
                h.remove()

    originals = {id(c): c for c in model.children()}
    handles = [c.register_forward_pre_hook(hook) for c in model.children()]
