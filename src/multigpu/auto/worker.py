"""What `multigpu run --auto` starts on every device: the launcher's worker, with the process
group formed and --auto's patches installed before the script runs.

    python -P -m multigpu.auto.worker global|per-gpu script.py ARGS...   (or ... -m pkg.mod ARGS)

The first argument is --auto-batch's mode. Then, in this order: this process's own GPU is the
only one it sees (before anything touches CUDA), the process group forms (NCCL on GPUs, gloo on
CPU), the patches go in (refusals, data, gradients, saving) and the script runs as the launcher's
worker runs any script: as `__main__`, with its argv, a mistake of the script's that --auto cannot
handle said in one line (`multigpu: error: ...`, exit 2).
"""
from __future__ import annotations

import sys

from multigpu.core import orphans

orphans.watch_from_env()  # first: a launcher dead already ends this worker before any import

from multigpu.auto import BATCH_MODES, devices  # noqa: E402
from multigpu.core.errors import UsageError  # noqa: E402
from multigpu.launcher import worker  # noqa: E402


def prepare(mode: str) -> None:
    """This process's GPU, its process group and the patches, before the script runs."""
    devices.narrow_to_own_gpu()
    from multigpu.auto import gradients, loaders, refusals, saving
    from multigpu.core.distributed import init_distributed

    env = init_distributed(own_gpu=True)
    refusals.install()
    split = loaders.install(env, mode)
    if env.world_size > 1:  # replicate() needs a process group; one process has nothing to average
        gradients.install()
        loaders.note_unsplit_training(env, split)
    saving.install(env)
    if env.rank == 0:
        batch = ("the script's batch_size is the global batch" if mode == "global"
                 else "the script's batch_size per process")
        print(f"multigpu: --auto: {env.world_size} process{'es' if env.world_size > 1 else ''} "
              f"({env.backend or 'no group'}, {env.device.type}); shuffled DataLoaders split, "
              f"{batch}; gradients averaged as DDP does; torch.save by rank 0", file=sys.stderr)


def main(argv: list[str]) -> None:
    mode, script = (argv[0], argv[1:]) if argv else ("", [])
    if mode not in BATCH_MODES or not script:
        raise UsageError(f"usage: python -m multigpu.auto.worker {'|'.join(BATCH_MODES)} "
                         "script.py ARGS (started by `multigpu run --auto`)")
    worker.main(script, before=lambda: prepare(mode))


if __name__ == "__main__":
    main(sys.argv[1:])
