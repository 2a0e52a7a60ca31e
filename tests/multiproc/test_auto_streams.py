"""`multigpu run --auto` of a script that trains on a stream (an IterableDataset), with and
without a __len__, with and without loader workers: every item once per epoch over the processes,
the same number of steps on each, equal weights; evaluation under no_grad reads the whole stream."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multiproc.test_run_cli import multigpu

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "auto_stream_train.py"


def run(tmp_path, ranks: int, *args: str) -> tuple[list[dict], str]:
    r = multigpu("--auto", "--devices", f"cpu:{ranks}", str(SCRIPT), *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = [json.loads((tmp_path / f"seen_rank{r}.json").read_text()) for r in range(ranks)]
    return seen, r.stderr


def assert_split_exactly(seen: list[dict], items: int) -> None:
    """Every item once per epoch over the ranks, as many steps on each rank, equal weights."""
    for epoch in (0, 1):
        steps = [[idx for e, idx in s["steps"] if e == epoch] for s in seen]
        assert len({len(s) for s in steps}) == 1, [len(s) for s in steps]
        assert sorted(i for s in steps for idx in s for i in idx) == list(range(items))
        assert all(idx for s in steps for idx in s), "no empty batch"
    assert all(s["weights"] == seen[0]["weights"] for s in seen)


@pytest.mark.parametrize("ranks, sized, workers", [
    (2, False, 2), (3, True, 0),
    pytest.param(2, True, 0, marks=pytest.mark.extended),  # about 12 s each on 2 cores
    pytest.param(3, False, 2, marks=pytest.mark.extended),
])
def test_a_stream_is_split_by_position_every_item_once_per_epoch(tmp_path, ranks, sized, workers):
    """A stream without a length was refused; one with a length ran whole on every rank."""
    items = 45 if ranks == 2 else 47  # not a multiple of the global batch: a last step of its own
    args = ["--items", str(items), "--workers", str(workers)] + (["--sized"] if sized else [])
    seen, stderr = run(tmp_path, ranks, *args)
    assert_split_exactly(seen, items)
    assert all(s["evaluated"] == [items, items] for s in seen), "evaluation reads it whole"
    if sized:  # len(loader): the steps of an epoch on each rank
        assert all(s["len"] == len(s["steps"]) // 2 for s in seen)
    assert "note" not in stderr


@pytest.mark.extended  # the position split keeps a test in the default tier
@pytest.mark.parametrize("ranks, workers, items", [
    (3, 2, 47),
    pytest.param(2, 0, 45, marks=pytest.mark.extended),
])
def test_a_stream_that_shards_itself_by_rank_is_not_split_again(tmp_path, ranks, workers, items):
    """Each rank's own share (item i to rank i % N, as the dataset reads RANK), streams of
    different lengths: they end together, the items past the shortest pooled and split."""
    seen, stderr = run(tmp_path, ranks, "--by-rank", "--items", str(items),
                       "--workers", str(workers))
    assert_split_exactly(seen, items)
    notes = [line for line in stderr.splitlines() if "note:" in line]
    assert len(notes) == 1 and notes[0].startswith(
        "multigpu: note: --auto: the script's IterableDataset (Stream) starts with another item "
        f"in each of the {ranks} processes: it shards itself by rank")
