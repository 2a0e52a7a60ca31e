"""Every process starts from rank 0's random seeds, so that a script that sets none draws on every
rank what one process draws.

A one-GPU script that never seeds draws fresh numbers at each start: its toy data
(`x = torch.randn(64, 1000)`), its initial weights, its dropout. Under --auto each process would
draw its own: the weights are made equal (rank 0's are sent), but data made in the script would
differ from rank to rank, and its gradients, averaged over the ranks, fit none of them (one public
example ended at a loss 6 000x its one-process run's). Seeded alike, every rank computes what one
process computes; what --auto splits (DataLoaders that shuffle) is still split, each rank reading
its own samples. A script that seeds itself is unchanged: its own seed replaces these.

torch's generators (the CPU's, and CUDA's as it starts), Python's `random` and numpy's global
generator, each from the seed rank 0's torch drew at its start (torch.initial_seed()); the three
calls of core.runtime.seed_everything, written here because importing that module (strategies,
precision) would add about 0.15 s to every --auto process's start.
"""
from __future__ import annotations

import random

import torch


def install(env) -> int:
    """Seed this process as rank 0 is seeded (a collective); returns the seed."""
    seed = int(env.broadcast_object(torch.initial_seed() if env.rank == 0 else None))
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is not a dependency of torch
        return seed
    numpy.random.seed(seed % 2**32)  # numpy's global seeds are 32-bit
    return seed
