"""Built-in models: reference parameter counts, shapes on small inputs, DDP-safe gradients, errors."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from multigpu.core.errors import UsageError
from multigpu.train.models.catalog import MODEL_NAMES, build_model, default_image_size, is_convnet, model_input_kind
from multigpu.train.models.seqmodels import SEQUENCE_MODELS
from multigpu.train.models.swin import WindowAttention

# Parameter counts of the reference ImageNet models (torchvision), for (3, 224, 224) in, 1000 out.
REFERENCE_PARAMETERS = {"resnet18": 11_689_512, "resnet50": 25_557_032, "vgg16": 138_357_544, "swin_t": 28_288_354}


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def imagenet_models():
    """Models built for (3, 224, 224) and 1000 classes, built once: vgg16 alone takes seconds to initialise.

    The models are size-agnostic (adaptive pooling, padded windows), so the same instances also serve the
    small-input tests."""
    cache: dict[str, torch.nn.Module] = {}

    def get(name: str) -> torch.nn.Module:
        if name not in cache:
            torch.manual_seed(0)
            cache[name] = build_model(name, (3, 224, 224), 1000)
        return cache[name]

    yield get
    cache.clear()


@pytest.mark.parametrize("name", sorted(REFERENCE_PARAMETERS))
def test_parameter_count_matches_reference_architecture(name, imagenet_models):
    model = imagenet_models(name)
    assert count(model) == REFERENCE_PARAMETERS[name]
    if name == "swin_t":  # the one transformer: check that 224 runs end to end (fast enough at batch 1)
        model.eval()
        with torch.no_grad():
            assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 8, 8)], ids=["rgb32", "digits"])
@pytest.mark.parametrize("name", [n for n in MODEL_NAMES if n not in SEQUENCE_MODELS])  # test_seqmodels
def test_forward_shape_and_every_parameter_gets_a_gradient(name, shape, imagenet_models):
    # DDP without find_unused_parameters needs every parameter in the graph of every step.
    if shape[0] == 3 and name in REFERENCE_PARAMETERS:
        model, outputs = imagenet_models(name), 1000
    else:
        torch.manual_seed(0)
        model, outputs = build_model(name, shape, 7), 7
    model.train().zero_grad(set_to_none=True)
    logits = model(torch.randn(2, *shape))
    assert logits.shape == (2, outputs)
    logits.sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


@pytest.mark.parametrize("name", ["linear", "mlp"])
def test_flat_models_take_any_shape_and_single_sample_batches(name):
    for shape in [(32,), (12, 3), (1, 8, 8)]:
        model = build_model(name, shape, 2).train()
        assert model(torch.randn(1, *shape)).shape == (1, 2)


def test_cnn_trains_on_a_single_digit():
    # The demo model must survive a last batch of one sample: its BatchNorms never see 1x1 maps at 8x8.
    model = build_model("cnn", (1, 8, 8), 10).train()
    assert model(torch.randn(1, 1, 8, 8)).shape == (1, 10)


def test_odd_image_sizes_work():
    # Swin pads windows and merges odd sizes; the convnets floor. (vgg16 skipped: slow to build, and its
    # pooling on tiny maps is covered by the digits case above.)
    for name in ["cnn", "resnet18", "swin_t"]:
        model = build_model(name, (3, 17, 23), 5)
        assert model(torch.randn(2, 3, 17, 23)).shape == (2, 5)


@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet18", "swin_t"])
def test_initialisation_is_deterministic_given_the_seed(name):
    states = []
    for _ in range(2):
        torch.manual_seed(123)
        states.append(build_model(name, (3, 32, 32), 10).state_dict())
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_shifted_window_mask_blocks_attention_across_the_wrap_around_seam():
    torch.manual_seed(0)
    attention = WindowAttention(dim=8, heads=2, window=7).eval()
    x = torch.randn(1, 14, 14, 8)
    bumped = x.clone()
    bumped[0, 0, 0] += 10.0
    with torch.no_grad():
        before, after = attention(x, (3, 3)), attention(bumped, (3, 3))
    changed = (before - after).abs().amax(dim=-1)[0] > 1e-6
    # Rolled by 3, token (0, 0) shares a window with (1, 1) and, across the seam, with (10, 10) and (13, 13).
    assert changed[1, 1]
    assert not changed[10, 10]
    assert not changed[13, 13]
    assert not changed[5, 5]  # another window altogether


def test_input_kind_image_size_and_convnet_flags():
    assert model_input_kind("linear") == model_input_kind("mlp") == "flat"
    for name in ["cnn", "resnet18", "resnet50", "vgg16", "swin_t", "torchvision:resnet18", "timm:resnet18"]:
        assert model_input_kind(name) == "image"
    assert default_image_size("cnn") == 32
    for name in ["resnet18", "resnet50", "vgg16", "swin_t", "torchvision:vit_b_16", "timm:resnet18"]:
        assert default_image_size(name) == 224
    assert [n for n in MODEL_NAMES if is_convnet(n)] == ["cnn", "resnet18", "resnet50", "vgg16"]
    assert not is_convnet("timm:resnet18")


def test_unknown_model_lists_the_choices():
    for function in (build_model, model_input_kind, default_image_size, is_convnet):
        args = ("resnet19", (3, 32, 32), 10) if function is build_model else ("resnet19",)
        with pytest.raises(UsageError) as excinfo:
            function(*args)
        assert str(excinfo.value) == (
            "unknown model 'resnet19': choose one of linear, mlp, cnn, resnet18, resnet50, vgg16, swin_t, lstm, tst "
            "or torchvision:NAME / timm:NAME"
        )
    with pytest.raises(UsageError, match="model 'timm:' names no timm model: write timm:NAME"):
        model_input_kind("timm:")


def test_image_model_on_non_image_data_says_which_model_to_use():
    with pytest.raises(UsageError, match=r"model 'resnet18' needs image samples .* shaped \(12, 3\): use --model mlp"):
        build_model("resnet18", (12, 3), 1)


@pytest.mark.parametrize("package", ["torchvision", "timm"])
def test_missing_external_package_says_how_to_install_it(monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # makes `import package` fail even where it is installed
    monkeypatch.setitem(sys.modules, f"{package}.models", None)
    with pytest.raises(UsageError) as excinfo:
        build_model(f"{package}:resnet18", (3, 32, 32), 10)
    assert str(excinfo.value) == (
        f"model '{package}:resnet18' needs the {package} package, which is not installed: "
        f"run `pip install {package}` or use a built-in model "
        "(linear, mlp, cnn, resnet18, resnet50, vgg16, swin_t, lstm, tst)"
    )


def fake_package(monkeypatch, name: str, **attributes) -> list:
    """Install a stand-in `name` module whose builder records its calls."""
    calls: list = []
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    module.calls = calls
    monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_torchvision_models_are_built_through_get_model(monkeypatch):
    calls = fake_package(
        monkeypatch,
        "torchvision.models",
        list_models=lambda: ["resnet18"],
        get_model=lambda name, **kw: calls.append((name, kw)) or torch.nn.Identity(),
    )
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    assert isinstance(build_model("torchvision:resnet18", (3, 64, 64), 10), torch.nn.Identity)
    assert calls == [("resnet18", {"num_classes": 10})]
    with pytest.raises(UsageError, match="unknown torchvision model 'resnet19' in 'torchvision:resnet19'"):
        build_model("torchvision:resnet19", (3, 64, 64), 10)
    with pytest.raises(UsageError, match="expects 3-channel images but the data has 1 channel"):
        build_model("torchvision:resnet18", (1, 8, 8), 10)


def test_timm_models_are_built_through_create_model(monkeypatch):
    calls = fake_package(
        monkeypatch,
        "timm",
        is_model=lambda name: name == "resnet18",
        create_model=lambda name, **kw: calls.append((name, kw)) or torch.nn.Identity(),
    )
    build_model("timm:resnet18", (1, 8, 8), 10)
    assert calls == [("resnet18", {"pretrained": False, "num_classes": 10, "in_chans": 1})]
    with pytest.raises(UsageError, match="unknown timm model 'resnet19' in 'timm:resnet19'"):
        build_model("timm:resnet19", (3, 64, 64), 10)
