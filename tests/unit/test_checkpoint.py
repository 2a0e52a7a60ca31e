"""Checkpoints: atomic, no `module.` prefix, portable between strategies and into bare models."""
import os

import pytest
import torch
from torch import nn

import multigpu
from multigpu.core.checkpoints import checkpoint


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_prefixed_state_dicts_load_into_a_bare_model():
    src = small_model()
    prefixed = {"module." + k: v for k, v in src.state_dict().items()}
    compiled_ddp = {"_orig_mod.module." + k: v for k, v in src.state_dict().items()}
    for sd in (prefixed, compiled_ddp):
        dst = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        checkpoint.load_model_state(dst, sd)
        assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))


def test_wrapped_model_saves_without_prefix_and_loads_with_weights_only(tmp_path):
    rt = multigpu.setup("single", accelerator="cpu")
    model = small_model()
    wrapped = nn.DataParallel(model)  # on CPU DataParallel is a thin wrapper, keys get `module.`
    assert next(iter(wrapped.state_dict())).startswith("module.")
    opt = torch.optim.Adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.9)
    rt.save(tmp_path / "ck.pt", model=wrapped, optimizer=opt, scheduler=sched, epoch=3, step=12)
    state = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])
    assert {"model", "optimizer", "scheduler", "precision", "rng", "epoch", "step"} <= set(state)
    bare = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    bare.load_state_dict(state["model"])  # plain torch, no multigpu
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), bare.parameters()))
    assert (state["epoch"], state["step"]) == (3, 12)


def test_load_restores_optimizer_scheduler_and_rng(tmp_path):
    rt = multigpu.setup("single", accelerator="cpu")
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    rt.save(tmp_path / "ck.pt", model=model, optimizer=opt, scheduler=sched)
    expected = torch.rand(3)  # the draw right after saving
    torch.manual_seed(123)
    model2 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, 0.5)
    rt.load(tmp_path / "ck.pt", model=model2, optimizer=opt2, scheduler=sched2)
    assert torch.equal(torch.rand(3), expected)
    assert opt2.param_groups[0]["lr"] == 0.25
    assert "momentum_buffer" in opt2.state_dict()["state"][0]


def test_atomic_save_leaves_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    checkpoint.atomic_save({"v": torch.tensor(1)}, path)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError):
        checkpoint.atomic_save({"v": torch.tensor(2)}, path)
    monkeypatch.undo()
    assert checkpoint.load(path)["v"].item() == 1
    assert os.listdir(tmp_path) == ["last.pt"], "no temp file left behind"


def test_a_real_child_named_module_is_not_taken_for_a_wrapper_prefix():
    class Ema(nn.Module):  # like timm's ModelEmaV2: the model lives in `self.module`
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    src, dst = Ema(), Ema()
    checkpoint.load_model_state(dst, src.state_dict())
    assert torch.equal(dst.module.weight, src.module.weight)
    wrapped = {"module." + k: v for k, v in src.state_dict().items()}  # saved by hand-made DDP
    dst.module.weight.data.zero_()
    checkpoint.load_model_state(dst, wrapped)
    assert torch.equal(dst.module.weight, src.module.weight)


def test_optimizer_state_takes_the_layout_of_channels_last_weights():
    # A CPU run's checkpoint (contiguous state) resumed on GPUs (channels_last convnet weights):
    # CUDA's fused Adam refuses state laid out unlike its parameter.
    model = nn.Conv2d(3, 8, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    gpu_like = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    opt2 = torch.optim.Adam(gpu_like.parameters())
    opt2.load_state_dict(saved)
    checkpoint.match_optimizer_layout(opt2)
    for key in ("exp_avg", "exp_avg_sq"):
        state = opt2.state[gpu_like.weight][key]
        assert state.stride() == gpu_like.weight.stride()
        torch.testing.assert_close(state, saved["state"][0][key], rtol=0, atol=0)
