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

Once training begins (the first pass of a DataLoader --auto split, with gradients on), the ranks'
torch and numpy generators part: one process draws a fresh number for each sample of its batch
(a GAN's noise `np.random.normal(size=(batch, latent))`, dropout's masks), and the ranks, each
with a part of that batch, must draw different numbers too, or the global batch holds each draw N
times (PyTorch-GAN's gan.py and cgan.py under --auto ended below all 9 one-process runs at K=9).
Rank 0 keeps its stream, as one process would draw it; rank r goes on from the seed in use (a
script's own manual_seed included) plus r. Python's `random` stays the same on every rank: scripts
use it for decisions (skip a layer this step?) that must be the same on every rank, or the ranks'
gradients would not match up.
"""
from __future__ import annotations

import random
import sys

import torch

RANK_STRIDE = 1_000_003  # rank r's training seed: the seed in use + r * this (a prime)


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


def part_in_training(reads, rank: int) -> None:
    """From the first training pass of a split DataLoader on (reads: training_reads.TrainingReads),
    rank r > 0 draws its own torch and numpy numbers (the module docstring says why)."""
    if rank == 0:
        return
    parted = []

    def part(_batch: int) -> None:
        if parted:
            return
        parted.append(True)
        seed = (torch.initial_seed() + rank * RANK_STRIDE) % 2**63
        torch.manual_seed(seed)
        numpy = sys.modules.get("numpy")  # only a numpy the script has imported
        if numpy is not None:
            numpy.random.seed(seed % 2**32)
    reads.on_split.append(part)
