"""What `multigpu run --auto` starts on every device: the launcher's worker, with the process
group formed and --auto's patches installed before the script runs.

    python -P -m multigpu.auto.worker global|per-gpu script.py ARGS...   (or ... -m pkg.mod ARGS)

The first argument is --auto-batch's mode. Then, in this order: this process's own GPU is the
only one it sees (before anything touches CUDA), the process group forms (NCCL on GPUs, gloo on
CPU), the patches go in (refusals, data, gradients, the first step's checks, summed losses,
notes, saving, files) and the script runs as the launcher's worker runs any script: as
`__main__`, with its argv, a mistake of the script's that --auto cannot handle said in one
line (`multigpu: error: ...`, exit 2).
"""
from __future__ import annotations

import os
import sys

from multigpu.core.system import orphans

orphans.watch_from_env()  # first: a launcher dead already ends this worker before any import

from multigpu.auto import BATCH_MODES, FIND_UNUSED_ENV, devices  # noqa: E402
from multigpu.core.errors import UsageError  # noqa: E402
from multigpu.launcher.rank import worker  # noqa: E402


def prepare(mode: str) -> None:
    """This process's GPU, its process group and the patches, before the script runs."""
    devices.narrow_to_own_gpu()
    from multigpu.auto import batchnorm, first_step, gradients, notes, refusals, seeds, summed_loss, tracing
    from multigpu.auto.writes import files, saving
    from multigpu.auto.data import loaders, training_reads
    from multigpu.core.distributed import init_distributed

    env = init_distributed(own_gpu=True)
    if env.world_size > 1:
        seeds.install(env)  # first: before anything of --auto's or the script's draws
    refusals.install()
    split = loaders.install(env, mode)
    if env.world_size > 1:  # replicate() needs a process group; one process has nothing to average
        # each process normalizes batch_size / N samples: BatchNorm's statistics over all of them
        norms = batchnorm.install() if mode == "global" else None
        gradients.install(env, find_unused=os.environ.get(FIND_UNUSED_ENV) == "1",
                          adopt=norms.adopt if norms is not None else None)
        tracing.install()  # a replicated module traced (add_graph) as the script's plain one
    if env.world_size > 1:
        reads = training_reads.TrainingReads(env.world_size)
        reads.install()
        seeds.part_in_training(reads, env.rank)  # each rank its own noise for its samples
        if mode == "global":  # each process reads batch_size / N
            first_step.install(reads)
            summed_loss.install(reads, env.rank)
    if env.world_size > 1:
        notes.install(env, split)  # what --auto left unsplit, said when training starts
    saving.install(env)
    files.install(env)  # ranks other than 0 write their own copies of the script's files
    if env.rank == 0:
        print(start_line(env.world_size, env.backend, env.device.type, mode), file=sys.stderr)


def start_line(world_size: int, backend: str | None, device: str, mode: str) -> str:
    """What rank 0 says first: what --auto does in this run. One process has nothing to split
    or average: said so, with the flag that gives it more."""
    if world_size == 1:
        return ("multigpu: --auto: 1 process, so the script runs as it is, with nothing to split "
                "or average; --devices N (GPUs) or --devices cpu:N (CPU processes) makes it "
                "data-parallel")
    batch = ("the script's batch_size is the global batch" if mode == "global"
             else "the script's batch_size per process")
    return (f"multigpu: --auto: {world_size} processes ({backend}, {device}); shuffled "
            f"DataLoaders split, {batch}; gradients averaged as DDP does; the files it writes "
            f"are rank 0's")


def main(argv: list[str]) -> None:
    mode, script = (argv[0], argv[1:]) if argv else ("", [])
    if mode not in BATCH_MODES or not script:
        raise UsageError(f"usage: python -m multigpu.auto.worker {'|'.join(BATCH_MODES)} "
                         "script.py ARGS (started by `multigpu run --auto`)")
    worker.main(script, before=lambda: prepare(mode))


if __name__ == "__main__":
    main(sys.argv[1:])
