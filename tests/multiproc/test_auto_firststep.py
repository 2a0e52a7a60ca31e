"""`multigpu run --auto` on 2 CPU processes: a script that shapes tensors with its own batch size
is stopped at its first step in one line (and `doctor --auto` says the same line); a model whose
forward is called directly (forward-forward training) has its gradients averaged at each
optimizer step; a loss summed over the batch (reduction='sum') keeps one process's gradient."""
from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import pytest
import torch

from tests.multiproc.conftest import multigpu as cli
from tests.multiproc.test_run_cli import multigpu

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
RESHAPE = SCRIPTS / "auto_reshape_batch.py"


def line_of(script: Path, marker: str) -> int:
    return next(i for i, line in enumerate(script.read_text().splitlines(), 1) if marker in line)


def reshape_error(where: str) -> str:
    return (f"multigpu: error: {where}: mat1 and mat2 shapes cannot be multiplied (100x392 and "
            "784x32), in the first training step: --auto splits the DataLoader's batch_size=100 "
            "(the global batch) over 2 processes, batch_size / 2 = 50 samples each, and this "
            "shape has 100 where a batch has 50; write x.size(0) or -1 where the script uses its "
            "batch size, or run with --auto-batch per-gpu (100 per process: a global batch of 200 "
            "at the script's learning rate, 2x fewer steps per epoch)")


def test_a_shape_made_with_the_scripts_batch_size_stops_the_first_step_in_one_line(tmp_path):
    r = multigpu("--auto", "--devices", "cpu:2", str(RESHAPE), cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    where = f"{RESHAPE}:{line_of(RESHAPE, 'the failing line')}"
    assert [x for x in r.stderr.splitlines() if "error" in x.lower()] == [reshape_error(where)]
    assert "Traceback" not in r.stderr and not (tmp_path / "model.pt").exists()


@pytest.mark.extended  # a second test of its change; the default tier keeps the first
def test_doctor_auto_says_the_same_line_for_it(tmp_path):
    shutil.copy(RESHAPE, tmp_path)
    r = cli("doctor", "--auto", "--devices", "cpu:2", RESHAPE.name, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    where = f"{RESHAPE.name}:{line_of(RESHAPE, 'the failing line')}"
    failed = [line for line in r.stdout.splitlines() if line.startswith("fail")]
    assert len(failed) == 1 and failed[0].endswith(reshape_error(where)[len("multigpu: error: "):])


def test_layers_trained_by_their_own_forward_have_their_gradients_averaged(tmp_path):
    """Forward-forward: each layer's optimizer steps after `self.forward(x)`, which never runs
    DDP's hooks; refused at the first step before, averaged at each step now. Then prediction
    calls the layers as modules with gradients on and no backward (DDP armed there would fail)."""
    script = SCRIPTS / "auto_ff_layers.py"
    r = multigpu("--auto", "--devices", "cpu:2", str(script), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x for x in r.stderr.splitlines() if "note" in x] == [
        "multigpu: note: --auto: the Layer's forward was not called through the module (its "
        ".forward(x), or another of its methods, called directly), so its gradients are averaged "
        "at each optimizer step (one all-reduce after backward, not overlapped with it: slower "
        "than DDP's)"]
    ranks = [json.loads((tmp_path / f"weights_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["weights"] == ranks[1]["weights"]

    # one process on the same global batch (rank 0's share, then rank 1's), from the same seed
    ff = runpy.run_path(str(script))
    x_all, y_all = ff["dataset"]()
    indices = ranks[0]["indices"] + ranks[1]["indices"]
    assert sorted(indices) == list(range(32))
    x, y = x_all[indices], y_all[indices]
    torch.manual_seed(0)
    net = ff["Net"]([8, 16, 16])
    net.train(ff["overlay"](x, y), ff["overlay"](x, 1 - y))
    for layer, seen in zip(net.layers, ranks[0]["weights"]):
        for key, value in layer.state_dict().items():
            torch.testing.assert_close(torch.tensor(seen[key]), value, rtol=0, atol=1e-5)


def test_a_summed_loss_keeps_one_processs_gradient_and_a_sum_by_hand_is_said(tmp_path):
    """BCE and nn.MSELoss with reduction='sum': each process's sum times 2, so the averaged
    gradient is that of the sum over the global batch; the KL term summed by hand is left as
    it is (its gradient 1/2 of one process's), said in one line."""
    script = SCRIPTS / "auto_sum_vae.py"
    r = multigpu("--auto", "--devices", "cpu:2", str(script), "--kld", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    loss_line = line_of(script, "loss = F.binary")  # the note names the torch loss's line
    backward_line = line_of(script, "loss.backward()")
    assert [x for x in r.stderr.splitlines() if "note" in x] == [
        f"multigpu: note: --auto: the script's loss F.binary_cross_entropy(reduction='sum') "
        f"({script}:{loss_line}) sums over the 4 samples of each process: --auto multiplies it by "
        "2 (the processes) while training, so that its gradient, averaged over them, is one "
        "process's on the global batch of 8, and the loss printed is on that scale (the sum over "
        "the global batch)",
        f"multigpu: note: --auto: the loss given to backward at {script}:{backward_line} holds a "
        "sum over the batch that is no torch loss (a .sum() over the 4 samples of each process): "
        "averaged over the 2 processes, its gradient is 1/2 of one process's on the global batch "
        "of 8; take the mean over the batch instead, or run with --auto-batch per-gpu (8 samples "
        "per process, summed as one process does: a global batch of 16 at the script's learning "
        "rate, 2x fewer steps per epoch)"]
    ranks = [json.loads((tmp_path / f"seen_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["weights"] == ranks[1]["weights"]

    # one process on the same global batches, its KL term halved (as the note says)
    vae = runpy.run_path(str(script))
    data = vae["Pixels"]()
    torch.manual_seed(0)
    model = vae["VAE"]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for a, b in zip(ranks[0]["steps"], ranks[1]["steps"]):
        x = data.x[a + b]
        optimizer.zero_grad()
        recon, mu, logvar = model(x)
        summed = vae["loss_function"](recon, x, mu, logvar, kld=False)
        kl = vae["loss_function"](recon, x, mu, logvar, kld=True) - summed
        (summed + kl / 2).backward()
        optimizer.step()
    for key, value in model.state_dict().items():  # float32 sums in another order: 1e-5
        torch.testing.assert_close(torch.tensor(ranks[0]["weights"][key]), value, rtol=0, atol=1e-5)
