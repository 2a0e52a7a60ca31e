"""Built-in models in plain PyTorch, plus `torchvision:NAME` and `timm:NAME` when those are installed.

`build_model(name, input_shape, num_outputs)` returns a freshly initialised model. It draws every
initial weight from torch's global RNG, so the caller seeds `torch.manual_seed` once and every rank
builds the same weights. Every built-in model returns logits of shape (batch, num_outputs), and
every one of its parameters takes part in every forward pass: DDP without
`find_unused_parameters=True` hangs or raises otherwise.

- `linear`, `mlp` flatten whatever they get (digits, synthetic vectors, timeseries windows).
- `lstm`, `tst` (a small transformer encoder) take timeseries windows (seq_length, columns) and
  predict future_length rows of every column (seqmodels.py).
- `cnn` is a small three-block convnet for digits and 32x32 images.
- `resnet18`, `resnet50`, `vgg16`, `swin_t` reproduce the standard ImageNet architectures: at input
  (3, 224, 224) with 1000 outputs their parameter counts match the reference ones (11 689 512,
  25 557 032, 138 357 544 and 28 288 354). They also run on small inputs (8x8 digits, 32x32) and on
  any number of input channels.

Hazard: a BatchNorm layer in training mode needs more than one value per channel. ResNets shrink
inputs of 32x32 or less to 1x1 feature maps, so a training batch of one such sample raises
("Expected more than 1 value per channel"); batches of 2 work, and so does anything at 224x224.
A last partial batch of one sample per rank is the usual way to get there; multigpu's sampler
(multigpu.core.loading.data) gives every device at least two samples per step whenever the dataset allows.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from multigpu.core.errors import UsageError
# the names and input kinds live in a torch-free module (the CLI checks --model with them);
# they are re-exported here for the code that builds models
from multigpu.train.models.model_names import (_FLAT_MODELS, MODEL_NAMES, SEQUENCE_MODELS, _parse,  # noqa: F401
                                  default_image_size, is_convnet, model_input_kind)
from multigpu.train.models.seqmodels import build_sequence_model


def build_model(name: str, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """Build model `name` for samples of shape `input_shape` with `num_outputs` logits, initialised from torch's RNG."""
    source, inner = _parse(name)
    input_shape = tuple(int(d) for d in input_shape)
    assert num_outputs >= 1, f"num_outputs must be positive, got {num_outputs}"
    if source is None and inner in SEQUENCE_MODELS:
        return build_sequence_model(inner, input_shape, num_outputs)
    if source is None and inner in _FLAT_MODELS:
        in_features = math.prod(input_shape)
        if inner == "linear":
            return nn.Sequential(nn.Flatten(), nn.Linear(in_features, num_outputs))
        # No BatchNorm1d on purpose: a last batch of one sample would make it raise.
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, 256),
            nn.ReLU(inplace=True),
            nn.Linear(256, 256),
            nn.ReLU(inplace=True),
            nn.Linear(256, num_outputs),
        )
    if len(input_shape) != 3:
        raise UsageError(
            f"model {name!r} needs image samples shaped (channels, height, width), but the data gives samples "
            f"shaped {input_shape}: use --model mlp or --model linear for this data"
        )
    channels = input_shape[0]
    if source is not None:
        return _build_external(source, inner, channels, num_outputs)
    if inner == "cnn":
        return _small_cnn(channels, num_outputs)
    if inner == "resnet18":
        return ResNet(_BasicBlock, (2, 2, 2, 2), channels, num_outputs)
    if inner == "resnet50":
        return ResNet(_Bottleneck, (3, 4, 6, 3), channels, num_outputs)
    if inner == "vgg16":
        return VGG16(channels, num_outputs)
    from multigpu.train.models.swin import SwinTransformer  # swin lives in its own module to keep this one short

    return SwinTransformer(channels, num_outputs)


def _build_external(source: str, inner: str, channels: int, num_outputs: int) -> nn.Module:
    name = f"{source}:{inner}"
    builtins = ", ".join(MODEL_NAMES)
    try:
        module = importlib.import_module("torchvision.models" if source == "torchvision" else "timm")
    except ImportError:
        raise UsageError(
            f"model {name!r} needs the {source} package, which is not installed: "
            f"run `pip install {source}` or use a built-in model ({builtins})"
        ) from None
    except Exception as exc:  # e.g. a torchvision built for another torch version
        raise UsageError(
            f"model {name!r} needs {source}, which is installed but fails to import ({type(exc).__name__}: {exc}): "
            f"reinstall a {source} that matches torch {torch.__version__}, or use a built-in model ({builtins})"
        ) from None
    if source == "torchvision":
        if inner not in module.list_models():
            raise UsageError(
                f"unknown torchvision model {inner!r} in {name!r}: "
                "see `python -c 'import torchvision; print(torchvision.models.list_models())'`"
            )
        if channels != 3:
            raise UsageError(
                f"model {name!r} expects 3-channel images but the data has {channels} channel(s): "
                f"use timm:{inner} (which adapts the input channels) or a built-in model ({builtins})"
            )
        return module.get_model(inner, num_classes=num_outputs)
    if not module.is_model(inner):
        raise UsageError(
            f"unknown timm model {inner!r} in {name!r}: "
            f"see `python -c 'import timm; print(timm.list_models(\"*{inner[:6]}*\"))'`"
        )
    return module.create_model(inner, pretrained=False, num_classes=num_outputs, in_chans=channels)


class _PoolIfRoom(nn.MaxPool2d):
    """A max pool that lets a feature map pass unchanged once it is too small to pool.

    Deep stacks of 2x2 pools (VGG has five) would shrink an 8x8 input to nothing; stopping at one
    pixel keeps small inputs working while leaving normal-sized inputs exactly as the standard does.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] < self.kernel_size or x.shape[-1] < self.kernel_size:
            return x
        return super().forward(x)


def _conv_bn_relu(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


def _small_cnn(channels: int, num_outputs: int) -> nn.Module:
    # Two pools take 8x8 digits to 2x2, so the last BatchNorm still sees 4 values per sample.
    model = nn.Sequential(
        *_conv_bn_relu(channels, 32),
        _PoolIfRoom(2),
        *_conv_bn_relu(32, 64),
        _PoolIfRoom(2),
        *_conv_bn_relu(64, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, num_outputs),
    )
    _init_conv_bn(model)
    return model


def _init_conv_bn(model: nn.Module) -> None:
    """He initialisation for convolutions (fan-out, as usual for ReLU convnets), unit BatchNorm."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def _projection(cin: int, cout: int, stride: int) -> nn.Module:
    """The shortcut of a residual block: identity when shapes match, else a strided 1x1 conv + BN."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.shortcut = _projection(cin, width, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class _Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, as in ResNet v1.5), 1x1 expand by 4, with a residual connection."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut = _projection(cin, cout, stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet with a 7x7/2 stem, a 3x3/2 max pool and four stages of widths 64..512."""

    def __init__(self, block: type[nn.Module], depths: tuple[int, ...], in_channels: int, num_outputs: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),  # padded, so it also works on 1x1 maps
        )
        stages, cin = [], 64
        for index, (width, depth) in enumerate(zip((64, 128, 256, 512), depths)):
            blocks = []
            for position in range(depth):
                stride = 2 if index > 0 and position == 0 else 1
                blocks.append(block(cin, width, stride))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_outputs)
        _init_conv_bn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


# Output channels of VGG-16's thirteen 3x3 convolutions; "M" is a 2x2 max pool.
_VGG16_LAYOUT = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    """VGG-16 (configuration D, no BatchNorm), pooled to 7x7 before the three-layer classifier."""

    def __init__(self, in_channels: int, num_outputs: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for item in _VGG16_LAYOUT:
            if item == "M":
                layers.append(_PoolIfRoom(2))
            else:
                layers += [nn.Conv2d(cin, item, 3, padding=1), nn.ReLU(inplace=True)]
                cin = item
        self.features = nn.Sequential(*layers)
        # Small inputs reach here as 1x1 maps; adaptive pooling repeats them to 7x7, as the standard model does.
        self.pool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(0.5),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(0.5),
            nn.Linear(4096, num_outputs),
        )
        _init_conv_bn(self)
        for m in self.classifier:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))
