"""The runtime guards on real `multigpu train` runs (2 CPU processes on gloo, through the launcher):
a loss that becomes NaN stops the run before any checkpoint holds weights trained past it, fp16
warns about a long run of skipped steps instead, and a global batch of several devices says once
what it means for --lr.

The divergence is caused for real: SGD whose learning rate the step scheduler multiplies by 100
after each epoch (0.05, then 5). A constant huge --lr either diverges within the first ~10 steps,
before any checkpoint, or kills every ReLU so the loss stays finite; this one trains a good first
epoch, saves checkpoints, and reaches NaN early in the second (step 103 of the run here).
"""
import re
from pathlib import Path

import pytest
import torch

from multigpu.train.checkpoints.checkpoint_store import CheckpointStore

from .conftest import multigpu

pytestmark = pytest.mark.slow

DIVERGES = ["--model", "mlp", "--data", "synthetic:3000", "--epochs", "3", "--batch-size", "16",
            "--optimizer", "sgd", "--lr", "0.05", "--scheduler", "step", "--step-size", "1",
            "--gamma", "100", "--workers", "0", "--seed", "4", "--deterministic",
            "--checkpoint-every", "20", "--logger", "none"]
NO_TRACEBACK = "Traceback (most recent call last)"


def stopped_at(stderr: str, out: Path, batches: int) -> tuple[int, Path]:
    """(the bad step, the last good checkpoint) from the one line the run ended with."""
    m = re.search(r"multigpu: error: the loss became (?:nan|inf|-inf) at step (\d+) \(epoch (\d+), "
                  rf"batch (\d+) of {batches}\); weights after it are not saved: the last good "
                  r"checkpoint is (\S+\.pt)\. Lower --lr \(now 0\.05, 5 at that step after "
                  r"--scheduler\), add --clip-grad-norm 1\.0, or check the data for NaN; resume "
                  rf"from it with --resume {re.escape(str(out))}\n", stderr)
    assert m, stderr[-3000:]
    step, epoch, batch = map(int, m.group(1, 2, 3))
    assert step == (epoch - 1) * batches + batch
    return step, Path(m.group(4))


def assert_nothing_saved_after(out: Path, bad_step: int, named: Path) -> None:
    store = CheckpointStore(out / "checkpoints")
    entries = store.entries()
    assert entries and all(e.global_step < bad_step for e in entries), (bad_step, entries)
    steps = [int(p.stem.split("-")[1]) for p in (out / "checkpoints").glob("step-*.pt")]
    assert steps and max(steps) < bad_step, (bad_step, steps)
    assert named == out / "checkpoints" / entries[-1].file  # the newest is the one named
    state = torch.load(named, weights_only=True)
    assert state["step"] == entries[-1].global_step
    assert all(torch.isfinite(t).all() for t in state["model"].values())


@pytest.mark.smoke
def test_a_nan_loss_on_two_processes_stops_with_one_line_and_no_checkpoint_after_it(tmp_path):
    out = tmp_path / "run"
    done = multigpu("train", *DIVERGES, "--devices", "cpu:2", "--out", out)
    assert done.returncode == 2, done.stderr[-3000:]
    bad_step, named = stopped_at(done.stderr, out, batches=94)
    assert NO_TRACEBACK not in done.stderr
    assert_nothing_saved_after(out, bad_step, named)
    assert "epoch 2 " not in done.stdout  # it never finished the epoch it diverged in


@pytest.mark.extended
def test_a_nan_loss_in_bf16_stops_too(tmp_path):
    out = tmp_path / "run"
    done = multigpu("train", *DIVERGES, "--devices", "cpu:1", "--batch-size", "32",
                    "--precision", "bf16", "--out", out)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("the loss became") == 1  # one process, one line
    bad_step, named = stopped_at(done.stderr, out, batches=94)
    assert NO_TRACEBACK not in done.stderr
    assert_nothing_saved_after(out, bad_step, named)


def test_fp16_goes_on_and_warns_once_about_the_skipped_steps(tmp_path):
    out = tmp_path / "run"
    done = multigpu("train", *DIVERGES, "--devices", "cpu:1", "--batch-size", "32",
                    "--precision", "fp16", "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the loss became" not in done.stderr
    warnings = [line for line in done.stderr.splitlines() if "skipped by fp16 loss scaling" in line]
    assert len(warnings) == 1, done.stderr[-3000:]  # the run of skips lasts 2 epochs: said once
    assert re.match(r"multigpu: warning: the last \d+ optimizer steps were all skipped by fp16 "
                    r"loss scaling \(loss scale now [\d.e+-]+\): the gradients hold inf/NaN at "
                    r"every scale", warnings[0]), warnings[0]
    assert "lower --lr (now 0.05, 5 at that step after --scheduler)" in warnings[0]
