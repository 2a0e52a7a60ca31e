"""Names of the built-in models and what input each needs, without importing torch.

The CLI checks `--model` with these before any process starts, so a typo costs one line and no
torch import; `multigpu.train.models.catalog` builds the models themselves.
"""
from __future__ import annotations

from multigpu.core.errors import UsageError

MODEL_NAMES: tuple[str, ...] = ("linear", "mlp", "cnn", "resnet18", "resnet50", "vgg16", "swin_t", "lstm", "tst")

_EXTERNAL_SOURCES = ("torchvision", "timm")
_FLAT_MODELS = frozenset({"linear", "mlp"})
SEQUENCE_MODELS = ("lstm", "tst")  # built by multigpu.train.models.seqmodels
_CONVNETS = frozenset({"cnn", "resnet18", "resnet50", "vgg16"})
_SMALL_IMAGE_MODELS = frozenset({"linear", "mlp", "cnn"})


def _parse(name: str) -> tuple[str | None, str]:
    """Split a model name into (source, model); source is None for built-ins. Raises on unknown names."""
    if name in MODEL_NAMES:
        return None, name
    source, sep, inner = name.partition(":")
    if sep and source in _EXTERNAL_SOURCES:
        if not inner:
            raise UsageError(f"model {name!r} names no {source} model: write {source}:NAME, e.g. {source}:resnet18")
        return source, inner
    raise UsageError(
        f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)} or torchvision:NAME / timm:NAME"
    )


def precision_for(kind: str, model: str) -> str:
    """--precision as `multigpu train` (and bench, doctor) runs the built-in `model`: "auto" is
    fp32 for the small sequence models (lstm, tst), and otherwise left to
    precision.resolve_precision.

    Their steps are a few milliseconds of small kernels, bound by the host: bf16 autocast adds a
    cast of every weight and activation per step, and cuDNN's LSTM runs its half-precision
    kernels slower at hidden size 64. Post 002's LSTM on 2x H200 (docs/performance.md):
    3.1-3.2 ms a step in fp32 against 4.0-4.6 ms with bf16 autocast; the transformer (tst)
    5.9-6.3 ms against 7.1-7.5 ms."""
    return "fp32" if kind == "auto" and model in SEQUENCE_MODELS else kind


def model_input_kind(name: str) -> str:
    """"flat" for models that flatten any input (linear, mlp); "sequence" for models of timeseries
    windows (lstm, tst); "image" for models that need (C, H, W)."""
    source, inner = _parse(name)
    if source is None and inner in SEQUENCE_MODELS:
        return "sequence"
    return "flat" if source is None and inner in _FLAT_MODELS else "image"


def default_image_size(name: str) -> int:
    """The image side length a model is designed for; synthetic data uses it when --image-size is not given."""
    source, inner = _parse(name)
    return 32 if source is None and inner in _SMALL_IMAGE_MODELS else 224


def is_convnet(name: str) -> bool:
    """True for the built-in convnets, which run faster in channels_last memory format.

    External models answer False: we cannot tell what architecture a name stands for.
    """
    source, inner = _parse(name)
    return source is None and inner in _CONVNETS


def check_input_kind(spec: str, input_kind: str) -> None:
    """Refuse data a model of `input_kind` cannot take (the CLI checks this before starting workers)."""
    assert input_kind in ("flat", "image", "sequence"), f"unknown input_kind {input_kind!r}"
    kind, sep, arg = spec.partition(":")
    timeseries = bool(sep and kind == "timeseries" and arg)
    if input_kind == "sequence" and not timeseries:
        raise UsageError(
            f"data {spec!r} is not a time series, which sequence models (lstm, tst) need: use "
            f"--data timeseries:co2, timeseries:macro or timeseries:CSV, or another --model for this data"
        )
    if input_kind == "image" and timeseries:
        raise UsageError(
            f"data {spec!r} gives (seq_length, columns) windows, which image models cannot take: "
            "use --model lstm, --model tst, --model mlp or --model linear"
        )
