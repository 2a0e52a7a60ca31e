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

from multigpu.errors import UsageError
from multigpu.strategies import registry

if TYPE_CHECKING:  # torch is imported where it is used: the CLI reads MODES and check() without it
    from torch import nn

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
TRAIN_MODES = (*MODES, "auto")  # `multigpu train --compile auto`: auto_mode decides, per run
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
# --compile auto turns CUDA graphs on from this many optimizer steps in the run. Measured on one
# H100, ResNet-50 bf16 batch 128: CUDA graphs save 10.5 ms a step (34.2 -> 23.7 ms, `multigpu
# bench`) and their first epoch took 46 s longer than eager's with an empty compile cache, 5 s
# longer from the cache (docs/performance.md).
# The rule takes the empty cache's cost. Where the input pipeline limits the step (that run's
# synthetic: data, made on the CPU, did), the graphs save less.
AUTO_COMPILE_S, AUTO_SAVED_MS = 46.0, 10.5
AUTO_MIN_STEPS = int(AUTO_COMPILE_S * 1000 / AUTO_SAVED_MS)


def auto_mode(device_type: str, strategy: str, accumulate: int, steps: int) -> tuple[str | None, str]:
    """--compile auto: (the mode, the line that says why). CUDA graphs where they can work and the
    run has at least AUTO_MIN_STEPS optimizer steps to win their compiling back; else no compiling."""
    off = "--compile auto: not compiled"
    if device_type != "cuda":
        return None, f"{off} (CUDA graphs need GPUs)"
    if not registry.info(strategy).cuda_graphs or accumulate > 1:
        why = f"--accumulate {accumulate}" if accumulate > 1 else f"--strategy {strategy}"
        return None, f"{off} (CUDA graphs cannot work with {why})"
    if steps < AUTO_MIN_STEPS:
        return None, (f"{off}: {steps:,} steps are too few to win back compiling (about "
                      f"{AUTO_COMPILE_S:.0f} s; from {AUTO_MIN_STEPS:,} steps CUDA graphs are used)")
    return "reduce-overhead", (f"--compile auto: CUDA graphs (reduce-overhead) for {steps:,} steps; "
                               "the first steps compile, the compile cache is kept for the next run")


def check(mode: str | None, device_type: str, strategy: str, accumulate: int = 1) -> None:
    """Refuse a mode the run cannot use, with the fix, before anything is compiled. `strategy`:
    a name of strategies.registry."""
    if mode is None or mode == "auto":
        return
    if mode not in MODES:
        raise UsageError(f"--compile {mode}: choose from {', '.join(MODES)}")
    if mode not in CUDA_GRAPH_MODES:
        return
    fix = "--compile default" if mode == "reduce-overhead" else "--compile max-autotune-no-cudagraphs"
    if accumulate > 1:  # the first micro-step's .grad would be graph memory the next replay reuses
        raise UsageError(f"--compile {mode} records CUDA graphs, whose next replay overwrites the "
                         f"gradients that --accumulate {accumulate} adds up; use --accumulate 1 "
                         f"with a larger --batch-size, or {fix}")
    facts = registry.info(strategy)
    if not facts.cuda_graphs:
        why = ("need one process per GPU; DataParallel drives all GPUs from one process"
               if facts.one_process else f"--strategy {strategy} cannot use (its collectives "
               "run outside the graphs)")
        raise UsageError(f"--compile {mode} records CUDA graphs, which {why}: use --strategy ddp, "
                         f"or {fix}")
    if device_type != "cuda":
        raise UsageError(f"--compile {mode} records CUDA graphs, which need GPUs; on "
                         f"{device_type} use {fix}")


def compile_model(model: nn.Module, mode: str | None) -> nn.Module:
    """`model` compiled in `mode` (None: returned as it is). Compiling happens at the first call."""
    import torch
    from torch import nn

    if mode is None:
        return model
    if isinstance(model, nn.DataParallel):
        check(mode, "cuda", "dp")
    use_persistent_cache()
    return torch.compile(model, mode=None if mode == "default" else mode)


def use_persistent_cache(environ=None) -> None:
    """torch.compile's caches in a per-user folder that outlives /tmp (torch's default place):
    ~/.cache/multigpu/torch-compile, or $XDG_CACHE_HOME's. A second run of the same model then
    compiles from the cache. Left alone where TORCHINDUCTOR_CACHE_DIR is set (a sweep sets its
    own). `multigpu train` calls it before anything imports torch._dynamo, which sets torch's
    default place in the variable; compile_model's call serves the library's users."""
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
