"""--auto's seeds (auto/seeds.py): every rank starts alike, then draws its own streams in training,
torch's, numpy's and Python's random each its own (no two ranks, no two generators share one)."""
import random

import numpy as np
import pytest
import torch

from multigpu.auto import seeds


class Env:
    """One rank of a group whose rank 0 drew `seed`: broadcast_object gives rank 0's object."""

    def __init__(self, rank: int, seed: int):
        self.rank, self.seed = rank, seed

    def broadcast_object(self, obj):
        return obj if self.rank == 0 else self.seed


class Reads:
    def __init__(self):
        self.on_split = []


def draws() -> dict:
    return {"torch": torch.randn(6).tolist(), "numpy": np.random.normal(size=6).tolist(),
            "random": [random.random() for _ in range(6)]}


def rank_draws(rank: int, seed: int = 1234) -> tuple[dict, dict]:
    """What rank `rank` draws after --auto's start, then in its first training passes."""
    torch.manual_seed(seed)  # rank 0's own start: torch.initial_seed() is what it broadcasts
    seeds.install(Env(rank, seed))
    before = draws()
    reads = Reads()
    seeds.part_in_training(reads, rank)
    for callback in reads.on_split * 2:  # two split passes: the streams part once
        callback(8)
    return before, draws()


def test_ranks_draw_alike_before_training_and_their_own_numbers_in_training():
    (before0, during0), (before1, during1) = rank_draws(0), rank_draws(1)
    assert before0 == before1
    for name in seeds.GENERATORS:
        assert during0[name] != during1[name], name
    assert rank_draws(1) == (before1, during1)  # a seed gives the same streams run after run


@pytest.mark.parametrize("rank", [None, 0, 1])
def test_torch_and_numpy_are_not_one_mersenne_twister_stream(rank):
    """Seeded S and S mod 2^32, torch's randint gave every second number numpy's gives."""
    torch.manual_seed(99)
    if rank is None:
        seeds.install(Env(0, 99))
    else:
        seeds.seed_generators(99, rank)
    ours = set(torch.randint(0, 2**31, (1000,)).tolist())
    theirs = set(np.random.randint(0, 2**31, 2000).tolist())
    assert len(ours & theirs) < 5


def test_every_stream_seed_differs_over_ranks_and_generators():
    chosen = {seeds.stream_seed(7, name, rank) for name in seeds.GENERATORS
              for rank in (None, 0, 1, 2, 3)}
    assert len(chosen) == 15 and all(0 <= s < 2**63 for s in chosen)
