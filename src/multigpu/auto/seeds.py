"""Every process starts from rank 0's random seeds, so that a script that sets none draws on every
rank what one process draws; once training begins, each rank draws its own numbers.

A one-GPU script that never seeds draws fresh numbers at each start: its toy data
(`x = torch.randn(64, 1000)`), its initial weights, its dropout. Under --auto each process would
draw its own: the weights are made equal (rank 0's are sent), but data made in the script would
differ from rank to rank, and its gradients, averaged over the ranks, fit none of them (one public
example ended at a loss 6 000x its one-process run's). Seeded alike, every rank computes what one
process computes. A script that seeds itself is unchanged: its own seed replaces these.

Once training begins (the first pass of a DataLoader --auto split, with gradients on), the ranks
part: one process draws a fresh number for each sample of its batch (a GAN's noise
`torch.randn(batch, latent)` or `np.random.normal(size=(batch, latent))`, dropout's masks), and
the ranks, each with its part of that batch, must draw different numbers too, or the global batch
holds each draw N times (PyTorch-GAN's cgan.py under --auto ended below all 9 of its one-process
runs). The data's order is not drawn from these generators: the split sampler's is rank 0's seed,
agreed by all, so every sample is still read once per epoch.

Each generator has a stream of its own: torch's (the CPU's, and CUDA's as it starts), Python's
`random` and numpy's global one are seeded from a hash of (seed, rank, generator's name), `alike`
for the rank before training. Seeded with one number, torch's and numpy's Mersenne Twisters would
be one stream (torch seeded S draws what numpy seeded S mod 2^32 draws), and seeds such as
S + rank give streams that start from related states. The seed is torch's in use
(torch.initial_seed(): rank 0's at the start, a script's own torch.manual_seed when it gave one),
so a seeded script draws the same numbers from run to run. Python's `random` parts too: a
decision a script draws from it each step (teacher forcing, a random crop) is then the rank's own,
as a torch draw is; one that changes which parameters take part in the loss must be drawn the same
on every rank by the script itself.

Written here rather than through core.runtime.seed_everything, because importing that module
(strategies, precision) would add about 0.15 s to every --auto process's start.
"""
from __future__ import annotations

import hashlib
import random
import sys

import torch

GENERATORS = ("torch", "numpy", "random")


def stream_seed(seed: int, generator: str, rank: int | None = None) -> int:
    """The 63-bit seed of one generator's stream: a hash of (seed, rank or `alike`, generator)."""
    key = f"{seed}/{'alike' if rank is None else rank}/{generator}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def seed_generators(seed: int, rank: int | None, *, torch_too: bool = True) -> None:
    """Seed torch's, Python's and numpy's global generators (numpy only where imported: it is not
    a dependency of torch) from `seed`, each with a stream of its own."""
    if torch_too:
        torch.manual_seed(stream_seed(seed, "torch", rank))
    random.seed(stream_seed(seed, "random", rank))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(stream_seed(seed, "numpy", rank) % 2**32)  # numpy's global seeds are 32-bit


def install(env) -> int:
    """Seed this process as rank 0 is seeded (a collective); returns the seed. torch keeps rank
    0's seed itself (torch.initial_seed() reads it); random and numpy streams of their own."""
    seed = int(env.broadcast_object(torch.initial_seed() if env.rank == 0 else None))
    torch.manual_seed(seed)
    try:
        import numpy  # noqa: F401 - imported here so that seed_generators seeds it
    except ImportError:
        pass
    seed_generators(seed, None, torch_too=False)
    return seed


def part_in_training(reads, rank: int) -> None:
    """From the first training pass of a split DataLoader on (reads: training_reads.TrainingReads),
    every rank draws from streams of its own (the module docstring says why)."""
    parted = []

    def part(_batch: int) -> None:
        if parted:
            return
        parted.append(True)
        seed_generators(torch.initial_seed(), rank)
    reads.on_split.append(part)
