"""The Runtime in one process: exact loss weighting, accumulation, and the DataParallel traps."""
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multigpu
from multigpu.core.errors import UsageError
from multigpu.core.strategies.dp import CheckedDataParallel


def train(batch_size, accumulate, n=10, epochs=2):
    rt = multigpu.setup("single", accelerator="cpu", seed=3, accumulate=accumulate)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = rt.prepare(model, opt, DataLoader(ds, batch_size=batch_size, shuffle=True))
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            rt.backward(nn.functional.mse_loss(model(x), y))
            steps += rt.step(opt)
    return model, steps


def test_accumulation_equals_the_larger_batch_including_the_short_last_window():
    big, big_steps = train(batch_size=4, accumulate=1)
    acc, acc_steps = train(batch_size=2, accumulate=2)
    assert big_steps == acc_steps == 6  # 3 optimizer steps per epoch: 4, 4, 2 samples
    for a, b in zip(big.parameters(), acc.parameters()):
        torch.testing.assert_close(a, b)


def test_prepare_rejects_an_already_wrapped_model():
    rt = multigpu.setup("single", accelerator="cpu")
    with pytest.raises(UsageError, match="already wrapped"):
        rt.prepare(nn.DataParallel(nn.Linear(2, 2)))


def test_prepare_takes_an_optimizer_factory_and_optimizers_of_other_parameters():
    rt = multigpu.setup("single", accelerator="cpu")
    loss_weights = nn.Parameter(torch.ones(2))  # learnable, outside any model: not refused
    extra = torch.optim.SGD([loss_weights], lr=0.1)
    frozen = nn.Linear(2, 2)
    frozen.bias.requires_grad_(False)
    made, model, same = rt.prepare(lambda params: torch.optim.AdamW(params, lr=1e-3), frozen, extra)
    assert model is frozen and same is extra
    assert made.param_groups[0]["params"] == [frozen.weight]  # trainable ones, in model order
    with pytest.raises(UsageError, match="returned a int; it must return a torch.optim.Optimizer"):
        rt.prepare(nn.Linear(2, 2), lambda params: 3)


def test_single_strategy_refuses_dp_on_cpu_and_unknown_names():
    with pytest.raises(UsageError, match="needs GPUs"):
        multigpu.setup("dp", accelerator="cpu")
    with pytest.raises(UsageError, match="unknown strategy 'fsdp2'"):
        multigpu.setup("fsdp2", accelerator="cpu")


def test_eval_forward_with_grad_enabled_warns_once():
    rt = multigpu.setup("single", accelerator="cpu")
    model = rt.prepare(nn.Linear(2, 2)).eval()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # Python's own filter, as a user's script runs under
        for batch in (4, 4, 3):  # an evaluation loop, its last batch smaller: one warning
            model(torch.randn(batch, 2))
    assert [(w.category, str(w.message)) for w in seen] == [
        (UserWarning, "the model ran in eval mode with gradients enabled, which keeps activations in "
                      "memory for nothing; wrap validation in torch.no_grad()")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(torch.randn(1, 2))


class WithCustomMethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x, tags=None):
        return self.fc(x)

    def my_forward(self, x):
        return self.fc(x)


def test_dataparallel_custom_method_is_a_clear_error():
    dp = CheckedDataParallel(WithCustomMethod())
    with pytest.raises(AttributeError, match="only model\\(x\\) splits the batch"):
        dp.my_forward(torch.randn(2, 2))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        dp.nothing_here  # noqa: B018 (the access is what must raise)


def test_dataparallel_warns_about_per_sample_lists():
    dp = CheckedDataParallel(WithCustomMethod())
    with pytest.warns(UserWarning, match="copies non-tensor arguments whole"):
        dp(torch.randn(3, 2), tags=["a", "b", "c"])


def test_accumulation_without_a_prepared_loader_is_refused():
    rt = multigpu.setup("single", accelerator="cpu", accumulate=2)
    model = rt.prepare(nn.Linear(2, 1))
    with pytest.raises(UsageError, match="counts micro-batches through the loaders"):
        rt.backward(model(torch.randn(3, 2)).sum())


def test_step_info_is_cleared_when_a_loader_is_exhausted():
    rt = multigpu.setup("single", accelerator="cpu")
    loader = rt.prepare(DataLoader(TensorDataset(torch.arange(6.0)), batch_size=4))
    for _ in loader:
        assert rt.step_info is not None
    assert rt.step_info is None, "a finished loader must not leave its last weights behind"


def test_save_refuses_values_that_weights_only_loading_would_refuse(tmp_path):
    import numpy as np

    rt = multigpu.setup("single", accelerator="cpu")
    model = rt.prepare(nn.Linear(2, 1))
    with pytest.raises(UsageError, match="cannot be read back with weights_only=True"):
        rt.save(tmp_path / "ck.pt", model=model, best=np.float64(0.5))
    assert not (tmp_path / "ck.pt").exists()
