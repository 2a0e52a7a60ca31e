"""--auto's first-step checks and its summed-loss scaling, in one process: which torch errors
name the script's global batch, which loss graphs sum over the batch by hand, and the factor a
torch loss with reduction='sum' gets while a split loader is read."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multigpu.auto.first_step import names_global_batch
from multigpu.auto.summed_loss import SummedLoss, summed_over
from multigpu.auto.data.training_reads import TrainingReads


@pytest.mark.parametrize("message, named", [
    ("mat1 and mat2 shapes cannot be multiplied (100x392 and 784x256)", True),
    ("shape '[100, -1]' is invalid for input of size 39200", True),
    ("Expected input batch_size (100) to match target batch_size (50).", True),
    ("mat1 and mat2 shapes cannot be multiplied (50x392 and 784x256)", False),
    ("shape '[1000, -1]' is invalid for input of size 39200", False),
    ("CUDA out of memory. Tried to allocate 100.00 MiB; see max_split_size_mb", False),
    ("element 0 of tensors does not require grad and does not have a grad_fn (100)", False),
])
def test_a_shape_error_names_the_global_batch_only_as_a_size_of_its_own(message, named):
    assert names_global_batch(message, global_batch=100, per_process=50) is named


def test_a_sum_over_the_batch_is_told_from_a_mean_and_from_a_sum_over_parameters():
    x = torch.randn(4, 3, requires_grad=True)
    weight = torch.randn(8, 3, requires_grad=True)
    bce = F.binary_cross_entropy(torch.sigmoid(x), torch.rand(4, 3), reduction="sum") * 2
    assert summed_over(x.sum().grad_fn, batch=4)
    assert summed_over((bce - 0.5 * torch.sum(1 + x - x.exp())).grad_fn, batch=4)  # a VAE's KL
    assert not summed_over(bce.grad_fn, batch=4)  # a torch loss, scaled already
    assert not summed_over((x.sum() / 4).grad_fn, batch=4)  # a mean written by hand
    assert not summed_over(x.pow(2).sum(1).mean().grad_fn, batch=4)
    assert not summed_over((x.mean() + 1e-4 * weight.pow(2).sum()).grad_fn, batch=4)


def test_a_torch_loss_summed_is_scaled_by_the_processes_while_a_split_loader_is_read(monkeypatch):
    reads = TrainingReads(world_size=2)
    summed = SummedLoss(reads, rank=1)  # not rank 0: no note printed here
    monkeypatch.setattr(F, "mse_loss", summed.wrap("mse_loss", F.mse_loss))
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3)
    plain = ((a - b) ** 2).sum()

    assert torch.equal(F.mse_loss(a, b, reduction="sum"), plain)  # no split loader read yet
    reads.split_batch = 2
    torch.testing.assert_close(F.mse_loss(a, b, reduction="sum"), 2 * plain)
    torch.testing.assert_close(nn.MSELoss(reduction="sum")(a, b), 2 * plain)  # calls F's
    with pytest.warns(UserWarning, match="size_average"):  # the legacy way, deprecated
        torch.testing.assert_close(F.mse_loss(a, b, size_average=False), 2 * plain)
    torch.testing.assert_close(F.mse_loss(a, b), plain / 12)  # a mean: as it is
    with torch.no_grad():
        torch.testing.assert_close(F.mse_loss(a, b, reduction="sum"), plain)  # evaluation


def test_the_first_steps_window_names_the_scripts_line_then_leaves_torch_alone():
    from multigpu.auto.first_step import FirstStepShapes
    from multigpu.core.errors import UsageError

    layer, batch = nn.Linear(784, 10), torch.randn(50, 784)
    window = FirstStepShapes(world_size=2)
    window.open(50)  # a split loader's first pass: 50 samples per process
    try:
        with pytest.raises(UsageError) as caught:
            layer(batch.reshape(100, -1))  # the script's line
        line = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1)
                    if "# the script's line" in text and "layer(" in text)
        assert str(caught.value).startswith(
            f"tests/unit/test_auto_firststep.py:{line}: mat1 and mat2 shapes cannot be multiplied "
            "(100x392 and 784x10), in the first training step: --auto splits the DataLoader's "
            "batch_size=100 (the global batch) over 2 processes, batch_size / 2 = 50 samples each")
    finally:
        window.close()
    with pytest.raises(RuntimeError, match="mat1 and mat2") as after:  # torch's own, as it is
        layer(batch.reshape(100, -1))
    assert not isinstance(after.value, UsageError)
