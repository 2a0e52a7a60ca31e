"""Mixed precision on CPU: fp16 loss scaling skips inf steps; bf16 autocast runs."""
import pytest
import torch

import multigpu
from multigpu.core.errors import UsageError
from multigpu.core.precision import Precision


def _one_step(rt, model, opt, inject_inf=False):
    x = torch.randn(8, 4)
    with rt.autocast():
        loss = model(x).float().pow(2).mean()
    rt.backward(loss)
    if inject_inf:
        next(model.parameters()).grad[0, 0] = float("inf")
    return rt.step(opt)


def test_fp16_scaler_skips_the_step_on_inf_gradients():
    rt = multigpu.setup("single", "fp16", accelerator="cpu")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.prepare(model, opt)
    _one_step(rt, model, opt)  # a normal step first, so the scale exists
    before = [p.detach().clone() for p in model.parameters()]
    scale = rt.precision.scaler.get_scale()
    _one_step(rt, model, opt, inject_inf=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "weights must not move"
    assert rt.precision.skipped_steps == 1
    assert rt.precision.scaler.get_scale() == scale / 2
    _one_step(rt, model, opt)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert rt.precision.skipped_steps == 1


def test_fp16_clipping_applies_to_unscaled_gradients():
    rt = multigpu.setup("single", "fp16", accelerator="cpu")
    model = torch.nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = rt.prepare(model, opt)
    # A small initial scale, so the scaled fp16 gradients stay finite and the step is taken.
    rt.precision.scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    w0 = model.weight.detach().clone()
    x = torch.full((2, 4), 10.0)
    with rt.autocast():
        loss = model(x).float().sum()
    rt.backward(loss)
    rt.step(opt, clip_grad_norm=1.0)
    # SGD with lr 1: the update is the clipped gradient, whose norm is 1 (not 1/scale).
    assert torch.linalg.vector_norm(model.weight - w0).item() == pytest.approx(1.0, rel=1e-3)


def test_bf16_autocast_runs_on_cpu():
    rt = multigpu.setup("single", "bf16", accelerator="cpu")
    model = rt.prepare(torch.nn.Linear(4, 2))
    with rt.autocast():
        out = model(torch.randn(3, 4))
    assert out.dtype == torch.bfloat16


def test_auto_precision_is_fp32_on_cpu_and_unknown_is_an_error():
    assert multigpu.setup("single", "auto", accelerator="cpu").precision.kind == "fp32"
    with pytest.raises(UsageError, match="unknown precision 'fp8'"):
        Precision("fp8", torch.device("cpu"))


def test_auto_is_fp32_for_the_small_sequence_models_and_an_explicit_choice_stands():
    from multigpu.train.models.model_names import precision_for

    assert [precision_for("auto", m) for m in ("lstm", "tst")] == ["fp32", "fp32"]
    assert [precision_for("auto", m) for m in ("resnet50", "mlp", "torchvision:resnet18")] == ["auto"] * 3
    assert [precision_for(k, "lstm") for k in ("bf16", "fp16", "fp32")] == ["bf16", "fp16", "fp32"]


def test_scaler_state_round_trips():
    p = Precision("fp16", torch.device("cpu"))
    p.scaler.scale(torch.tensor(1.0))
    p.scaler.update(1024.0)
    q = Precision("fp16", torch.device("cpu"))
    q.load_state_dict(p.state_dict())
    assert q.scaler.get_scale() == 1024.0


def test_fp16_with_two_optimizers_updates_the_scale_once_per_iteration():
    rt = multigpu.setup("single", "fp16", accelerator="cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model[1].parameters(), lr=0.1)
    model = rt.prepare(model)
    rt.precision.scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    with rt.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    rt.backward(loss)
    model[0].weight.grad[0, 0] = float("inf")
    rt.step(opt_a)
    rt.step(opt_b)  # unscaled with the same scale as opt_a: the update waits for the next backward
    assert rt.precision.skipped_steps == 1
    assert rt.precision.scaler.get_scale() == 8.0
