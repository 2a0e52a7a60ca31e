"""One-process emulations of what --auto's rank 0 draws (issue 38's gan/cgan shift).
    python emu.py MODES script.py ARGS   (MODES: comma list of plain, seedlike, dup)
seedlike: numpy's global generator seeded torch.initial_seed() % 2**32, as seeds.install does
  (torch's and numpy's MT19937 then give the same stream).
dup: the batch's noise drawn for half the batch and held twice (np.random.normal / randint of a
  first dimension 64 -> 32 drawn, tiled), as the 2 ranks seeded alike make the global batch."""
import runpy
import sys
import numpy as np
import torch

modes = set(sys.argv[1].split(","))
if "seedlike" in modes:
    np.random.seed(torch.initial_seed() % 2**32)
if "dup" in modes:
    normal, randint = np.random.normal, np.random.randint

    def half(size):
        return isinstance(size, tuple) and size[0] == 64 or size == 64

    def dnormal(loc=0.0, scale=1.0, size=None):
        if half(size):
            s = (32,) + tuple(size[1:])
            a = normal(loc, scale, s)
            return np.concatenate([a, a])
        return normal(loc, scale, size)

    def drandint(low, high=None, size=None, dtype=int):
        if half(size):
            a = randint(low, high, 32 if size == 64 else (32,) + tuple(size[1:]), dtype)
            return np.concatenate([a, a])
        return randint(low, high, size, dtype)
    np.random.normal, np.random.randint = dnormal, drandint
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
