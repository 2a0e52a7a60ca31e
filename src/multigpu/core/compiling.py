"""torch.compile for `multigpu train --compile [MODE]`, bench and the library's users.

Modes are torch.compile's. "reduce-overhead" (and "max-autotune") also capture the compiled
graphs as CUDA graphs: a step's hundreds of kernels are then launched by one call, which removes
the host's launch time that limits small batches (ResNet-50 bf16 at batch 32 on an H200: ~21 ms
a step eager, ~7 ms with CUDA graphs; docs/performance.md). Three rules come with
them:
- every step must start with `begin_step(model)`: a graph's outputs live in memory that its next
  replay overwrites, and this tells torch that the previous step's outputs are no longer used
  (engine.train_step and engine.evaluate call it);
- CUDA graphs need one process per GPU (they are per device and per thread): not on CPU and not
  under DataParallel, which drives every GPU from its own thread;
- no gradient accumulation: the first micro-step's gradients would be graph memory that the next
  replay overwrites.
Every new input shape (the last, partial batch of an epoch; validation) is compiled and recorded
once more, at the cost of time and memory, then replayed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from multigpu.core.errors import Api, Text, UsageError
from multigpu.core.strategies import registry

if TYPE_CHECKING:  # torch is imported where it is used: the CLI reads MODES and check() without it
    from torch import nn

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
TRAIN_MODES = (*MODES, "auto")  # `multigpu train --compile auto`: training.auto_mode decides
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
def check(mode: str | None, device_type: str, strategy: str, accumulate: int = 1) -> None:
    """Refuse a mode the run cannot use, with the fix, before anything is compiled. `strategy`:
    a name of strategies.registry. The message names compile_model's and setup()'s arguments
    (errors.Text; `multigpu train` says them as --compile, --strategy, --accumulate)."""
    if mode is None or mode == "auto":
        return
    given = Api("compile_model.mode", mode)
    if mode not in MODES:
        raise UsageError(Text(f"{{}}: choose from {', '.join(MODES)}", given))
    if mode not in CUDA_GRAPH_MODES:
        return
    fix = Api("compile_model.mode",
              "default" if mode == "reduce-overhead" else "max-autotune-no-cudagraphs")
    if accumulate > 1:  # the first micro-step's .grad would be graph memory the next replay reuses
        raise UsageError(Text(
            "{} records CUDA graphs, whose next replay overwrites the gradients that {} adds up; "
            "use {} with a larger {}, or {}", given, Api("setup.accumulate", accumulate),
            Api("setup.accumulate", 1), Api("DataLoader.batch_size", text="batch_size"), fix))
    facts = registry.info(strategy)
    if not facts.cuda_graphs:
        ddp = Api("setup.strategy", "ddp")
        if facts.one_process:
            raise UsageError(Text("{} records CUDA graphs, which need one process per GPU; "
                                  "DataParallel drives all GPUs from one process: use {}, or {}",
                                  given, ddp, fix))
        raise UsageError(Text("{} records CUDA graphs, which {} cannot use (its collectives run "
                              "outside the graphs): use {}, or {}", given,
                              Api("setup.strategy", strategy), ddp, fix))
    if device_type != "cuda":
        raise UsageError(Text(f"{{}} records CUDA graphs, which need GPUs; on {device_type} use {{}}",
                              given, fix))


def compile_model(model: nn.Module, mode: str | None) -> nn.Module:
    """`model` compiled in `mode` (None: returned as it is). Compiling happens at the first call.
    torch's compile cache stays where the process says (TORCHINDUCTOR_CACHE_DIR, else torch's
    place in /tmp): call use_persistent_cache() first, before torch is imported, for multigpu's."""
    import torch
    from torch import nn

    if mode is None:
        return model
    if isinstance(model, nn.DataParallel):
        check(mode, "cuda", "dp")
    return torch.compile(model, mode=None if mode == "default" else mode)


def use_persistent_cache(environ=None) -> None:
    """torch.compile's caches in a per-user folder that outlives /tmp (torch's default place):
    ~/.cache/multigpu/torch-compile, or $XDG_CACHE_HOME's. A second run of the same model then
    compiles from the cache. Left alone where TORCHINDUCTOR_CACHE_DIR is set (a sweep sets its
    own). It changes this process's environment, so only a caller that owns the process calls
    it: `multigpu train` and bench, before anything imports torch._dynamo, which sets torch's
    default place in the variable, and so before their workers start."""
    import os

    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, "multigpu", "torch-compile"))


def is_compiled(model: nn.Module) -> bool:
    """Whether `model`, or the module a DDP/DataParallel wrapper holds, went through torch.compile
    (torch.compile(m) or m.compile())."""
    from torch import nn

    while isinstance(model, nn.Module):
        if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None:
            return True
        model = getattr(model, "module", None)
    return False


def begin_step(model: nn.Module) -> None:
    """Mark a new step for CUDA graphs (see the module's docstring); free for other models."""
    if is_compiled(model):
        import torch

        torch.compiler.cudagraph_mark_step_begin()
