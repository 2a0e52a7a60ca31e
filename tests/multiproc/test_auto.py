"""`multigpu run --auto`: an unmodified one-device script, data-parallel on 2 CPU processes (gloo),
started as a user starts it; and the one-line refusals of what --auto cannot split."""
from __future__ import annotations

import json
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.multiproc.test_run_cli import clean_env, multigpu, start

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
TUTORIAL = SCRIPTS / "auto_tutorial.py"


def replayed_weights(steps: list[list], lr: float) -> dict[str, torch.Tensor]:
    """The tutorial's model trained in this one process on the same global batches in the same
    order (`steps`: each step's sample indices, rank 0's share then rank 1's), from the weights
    its torch.manual_seed(0) gives: what 2 processes averaging their gradients must reach."""
    script = runpy.run_path(str(TUTORIAL))  # its classes, not its main
    data = script["Indexed"](48, 1)
    torch.manual_seed(0)
    model = script["build_model"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for indices in steps:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(data.x[indices]), data.y[indices]).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.smoke
def test_tutorial_script_runs_data_parallel_unmodified(tmp_path):
    r = multigpu("--auto", "--devices", "cpu:2", str(TUTORIAL), "--batch", "8", "--epochs", "2",
                 "--dataparallel", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = {rank: json.loads((tmp_path / f"seen_rank{rank}.json").read_text()) for rank in (0, 1)}

    # every training sample once per epoch over the two ranks, 4 per rank per step, a new order
    # each epoch; the evaluation loader (no shuffle) whole on each rank
    orders = []
    for epoch in (0, 1):
        shares = {rank: [idx for e, idx in seen[rank]["steps"] if e == epoch] for rank in (0, 1)}
        assert [len(b) for b in shares[0]] == [4] * 6 and [len(b) for b in shares[1]] == [4] * 6
        order = [i for a, b in zip(shares[0], shares[1]) for i in a + b]
        assert sorted(order) == list(range(48))
        orders.append(order)
    assert orders[0] != orders[1]
    assert seen[0]["test_count"] == seen[1]["test_count"] == 16

    # the epoch lines once on the console (rank 1's go to its log)
    assert [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("epoch ")] \
        == ["epoch 0", "epoch 1"]

    # one model.pt, from rank 0, without DataParallel's `module.` prefix
    saved = torch.load(tmp_path / "model.pt")
    assert sorted(saved) == ["0.bias", "0.weight", "2.bias", "2.weight"]

    # equal weights on both ranks, and those of one process on the same global batches
    assert seen[0]["weights"] == seen[1]["weights"]
    steps = [a + b for (_, a), (_, b) in zip(seen[0]["steps"], seen[1]["steps"])]
    expected = replayed_weights(steps, lr=0.1)
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, rtol=0, atol=1e-5)
        assert torch.equal(saved[key], torch.tensor(seen[0]["weights"]["module." + key]))


def test_a_model_loaded_whole_then_copied_has_its_gradients_averaged_and_an_ema_copy(tmp_path):
    """Modules made without setting attributes (torch.load of a whole model, copy.deepcopy) are
    found when the optimizer gets their parameters: equal weights on both ranks, each having
    trained on its own half of every batch; a copy.deepcopy of the replicated model (an EMA
    copy, made after the optimizer) is a plain copy of the script's class, equal on both ranks."""
    r = multigpu("--auto", "--devices", "cpu:2", str(SCRIPTS / "auto_copied_model.py"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = [json.loads((tmp_path / f"weights_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0]["student"] == seen[1]["student"]
    start = torch.load(tmp_path / "whole.pt", weights_only=False).state_dict()
    assert all(not torch.equal(torch.tensor(seen[0]["student"][k]), v) for k, v in start.items())
    assert seen[0]["ema_class"] == seen[1]["ema_class"] == "Sequential"
    assert seen[0]["ema"] == seen[1]["ema"] and seen[0]["ema"] != seen[0]["student"]


def test_an_ema_copy_of_an_unseeded_model_is_the_same_on_every_rank(tmp_path):
    """A script without a seed starts its model from other weights in each process; rank 0's
    reached the others only at the first forward, after the script's EMA copy was made: each
    rank's EMA went on from its own start (and so did every decision the script took on it)."""
    r = multigpu("--auto", "--devices", "cpu:2", str(SCRIPTS / "auto_ema_unseeded.py"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = [json.loads((tmp_path / f"weights_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert seen[0]["model"] == seen[1]["model"]
    assert seen[0]["ema"] == seen[1]["ema"]


@pytest.mark.parametrize("script, args, line", [
    ("auto_own_group.py", [],
     "multigpu: error: auto_own_group.py calls torch.distributed.init_process_group itself, so it "
     "is distributed already and --auto would split it a second time; run it with `multigpu run "
     "auto_own_group.py` (without --auto)"),
    ("auto_tutorial.py", ["--batch", "7"],
     "multigpu: error: DataLoader(batch_size=7) cannot be split evenly over 2 processes: --auto "
     "takes batch_size as the global batch, batch_size / 2 per process; give a multiple of 2, or "
     "run with --auto-batch per-gpu to keep 7 per process"),
    ("auto_unused_head.py", [],
     "multigpu: error: 2 trainable parameter(s) of the TwoHeads got no gradient in the first step "
     "(spare_head.weight, spare_head.bias): --auto averages gradients as DDP does, which needs "
     "every trainable parameter in each step's loss; freeze what the loss does not use "
     "(requires_grad_(False)), or run with --auto-unused (DDP then looks for unused parameters "
     "each step: slower)"),
])
def test_what_auto_cannot_split_is_refused_in_one_line(tmp_path, script, args, line):
    r = multigpu("--auto", "--devices", "cpu:2", str(SCRIPTS / script), *args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert [x for x in r.stderr.splitlines() if "error" in x.lower()] == [line]
    assert "Traceback" not in r.stderr and not (tmp_path / "model.pt").exists()


@pytest.mark.extended  # about 8 s on 2 cores: CI runs it (make test-all); the refusal is in make test
def test_auto_unused_trains_a_model_with_a_head_the_loss_leaves_out(tmp_path):
    r = multigpu("--auto", "--auto-unused", "--devices", "cpu:2", str(SCRIPTS / "auto_unused_head.py"),
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    weights = [json.loads((tmp_path / f"weights_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert weights[0] == weights[1]  # each rank trained on its half: the gradients were averaged
    assert sorted(weights[0]) == ["body.bias", "body.weight", "head.bias", "head.weight",
                                  "spare_head.bias", "spare_head.weight"]



def test_an_optimizer_whose_step_runs_a_closure_has_its_gradients_averaged(tmp_path):
    """LBFGS: the forward and backward run inside optimizer.step(closure), so the checks of the
    first step look after it (they refused 'forward never ran', or every parameter as unused)."""
    r = multigpu("--auto", "--devices", "cpu:2", str(SCRIPTS / "auto_lbfgs.py"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    weights = [json.loads((tmp_path / f"weights_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert weights[0] == weights[1]  # each rank trained on its half: the gradients were averaged

def test_lbfgs_with_a_line_search_decides_on_the_loss_of_every_rank(tmp_path):
    """LBFGS's line search and its stopping tests read the loss its closure returns: each rank's
    own half-batch loss made the ranks take different steps and call the closure a different
    number of times (a hang in the gradient averaging). Averaged over the ranks, every rank takes
    the step one process takes on the whole batch."""
    r = multigpu("--auto", "--devices", "cpu:2", str(SCRIPTS / "auto_lbfgs_line_search.py"),
                 cwd=tmp_path, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"weights_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]
    alone = tmp_path / "alone"
    alone.mkdir()
    subprocess.run([sys.executable, str(SCRIPTS / "auto_lbfgs_line_search.py")], cwd=alone,
                   check=True, env=clean_env(), timeout=60)
    expected = json.loads((alone / "weights_rank0.json").read_text())
    for key, value in expected.items():  # sums in another order, through up to 36 iterations
        torch.testing.assert_close(torch.tensor(ranks[0][key]), torch.tensor(value),
                                   rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("args, line", [
    (["--auto-unused", "x.py"],
     "multigpu: error: --auto-unused is a choice of --auto: add --auto, or drop --auto-unused"),
    (["--auto-batch", "per-gpu", "x.py"],
     "multigpu: error: --auto-batch per-gpu is a choice of --auto: add --auto, or drop --auto-batch"),
    (["--auto", "x.sh"],
     "multigpu: error: --auto makes a Python training script data-parallel, and x.sh is not one "
     "(not .py, no python shebang); run it without --auto"),
])
@pytest.mark.smoke
def test_bad_auto_flags_are_refused_before_any_process_starts(tmp_path, args, line):
    (tmp_path / "x.py").write_text("print('ran')\n")
    (tmp_path / "x.sh").write_text("echo ran\n")
    r = multigpu("--devices", "cpu:2", *args, cwd=tmp_path)
    assert (r.returncode, r.stderr.splitlines(), r.stdout) == (2, [line], "")


def test_ctrl_c_stops_the_script_in_one_line(tmp_path, procs):
    """Ctrl-C reaches the launcher only (torchrun starts each rank in a session of its own), which
    passes SIGINT on: the script's KeyboardInterrupt is not an error to show in 30 lines."""
    p = start("--auto", "--devices", "cpu:2", str(TUTORIAL), "--epochs", "1000000", cwd=tmp_path)
    procs.append(p)
    assert any(line.startswith("epoch 0:") for line in p.stdout), p.communicate()  # stops at it
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.splitlines()[-1].startswith("multigpu: stopped by SIGINT; every rank of this node "
                                           "was stopped"), err[-3000:]


@pytest.mark.parametrize("batch", ["global", "per-gpu"])
def test_noise_drawn_in_training_is_each_rank_s_own_while_data_made_before_is_alike(tmp_path, batch):
    """A GAN draws its noise for each sample of its batch: with the ranks seeded alike, the global
    batch held each draw twice. Once training begins on a split loader, torch's, numpy's and
    random's draws differ from rank to rank; what was drawn before stays alike, every sample is
    read once per epoch over the ranks, and the weights stay equal."""
    r = multigpu("--auto", "--auto-batch", batch, "--devices", "cpu:2", str(SCRIPTS / "auto_noise.py"),
                 str(tmp_path), cwd=tmp_path, TMPDIR=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    drawn = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert drawn[0]["before"] == drawn[1]["before"]
    steps = len(drawn[0]["during"])
    assert steps == (8 if batch == "global" else 4) and len(drawn[1]["during"]) == steps
    for step in range(steps):
        zero, one = drawn[0]["during"][step], drawn[1]["during"][step]
        for name in ("torch", "numpy", "random"):
            assert zero[name] != one[name], (step, name)
    for epoch in (0, 1):
        read = sorted(i for d in drawn for s in d["during"] if s["epoch"] == epoch for i in s["index"])
        assert read == list(range(32)), epoch
    assert drawn[0]["weights"] == drawn[1]["weights"]


def test_a_script_that_seeds_nothing_draws_on_every_rank_what_rank_0_draws(tmp_path):
    """Its own data (torch.randn), random and numpy: rank 1 draws rank 0's numbers, so the
    averaged gradients fit the one data set one process would fit (the files go to the temp
    folder, which --auto's file copies leave alone)."""
    r = multigpu("--auto", "--devices", "cpu:2", str(SCRIPTS / "auto_unseeded.py"), str(tmp_path),
                 cwd=tmp_path, TMPDIR=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    drawn = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert drawn[0] == drawn[1]
