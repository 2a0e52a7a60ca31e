"""The settings of `multigpu train`: the run's own, and one checked piece per component.

Each component owns its configuration, defined and checked beside the module that uses it:
strategy options (core/strategies/options.py), precision (core/precision_config.py), logging
(core/loggers.py), data (data_config.py), checkpointing (checkpoint_config.py) and optimisation
(optim_config.py). TrainConfig holds the run-level fields and one of each.

Users see none of this nesting: the flags, `config.json` and the config files they pass are flat
(`--batch-size`, "batch_size"), in the order of FLAT_NAMES. The parser is built from the fields'
metadata, so a flag, its default and its documentation can never drift apart; `flatten` and
`TrainConfig.from_flat` turn one form into the other.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields

from multigpu.core.compiling import TRAIN_MODES as COMPILE_MODES
from multigpu.core.loggers import LoggingConfig
from multigpu.core.options import Flag, check_options, option
from multigpu.core.precision_config import PrecisionConfig
from multigpu.core.strategies.options import StrategyConfig
from multigpu.train.settings.checkpoint_config import CheckpointConfig
from multigpu.train.data.data_config import DataConfig
from multigpu.train.models.model_names import check_input_kind, model_input_kind
from multigpu.train.settings.optim_config import OptimConfig

# TrainConfig's field -> the component it holds
COMPONENTS = {"input": DataConfig, "optim": OptimConfig, "numerics": PrecisionConfig,
              "parallel": StrategyConfig, "checkpointing": CheckpointConfig,
              "logging": LoggingConfig}


@dataclass(frozen=True)
class TrainConfig:
    model: str = option(MISSING, "built-in model (linear, mlp, cnn, resnet18, resnet50, vgg16, "
                                 "swin_t; lstm, tst for timeseries:), or torchvision:NAME / "
                                 "timm:NAME when installed")
    epochs: int = option(10, "passes over the training set", at_least=1)
    devices: str = option("auto", "auto (all free GPUs, or 1 CPU process) | N (N free GPUs) | 0,3 "
                                  "(those GPU ids) | cpu:N (N CPU processes on gloo)")
    min_free_memory: float = option(2.0, "GiB a GPU must have free for --devices auto|N to take "
                                         "it", at_least=0, example=2)
    seed: int = option(0, "seed for weights, data order and augmentation (identical on every "
                          "rank)")
    out: str | None = option(None, "run folder (default: a new runs/<time>-<model>-<data>/); "
                                   "never overwritten")
    compile: str | None = option(None, "torch.compile the model in MODE: default (--compile "
                                       "alone), reduce-overhead (CUDA graphs: a step's kernels "
                                       "launched at once; much faster small batches, GPUs only), "
                                       "max-autotune, max-autotune-no-cudagraphs, or auto (CUDA "
                                       "graphs where they work and the run is long enough to win "
                                       "back compiling; compiled code is cached in "
                                       "~/.cache/multigpu/torch-compile)",
                                 choices=COMPILE_MODES, flag=Flag(metavar="MODE", const="default"))
    deterministic: bool = option(False, "deterministic kernels (cuDNN, torch.use_deterministic_"
                                        "algorithms): an interrupted and resumed run ends with "
                                        "the same weights as an uninterrupted one, bit for bit")
    cudnn_benchmark: str = option("on", "GPUs: on times cuDNN's convolution algorithms at the first "
                                        "step and keeps the fastest (torch.backends.cudnn.benchmark: "
                                        "seconds once, faster steps after for some models), off leaves "
                                        "the choice to cuDNN's heuristics (a faster start)",
                                  choices=("on", "off"))
    input: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    numerics: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: StrategyConfig = field(default_factory=StrategyConfig)
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        check_options(self)
        check_input_kind(self.input.data, model_input_kind(self.model))  # an unknown model too

    @classmethod
    def from_flat(cls, **values) -> TrainConfig:
        """The config of flat settings (flag names: batch_size=64, strategy="ddp"), each given to
        the component that owns it; those left out take their defaults."""
        unknown = set(values) - set(FLAT_NAMES)
        if unknown:
            raise TypeError(f"TrainConfig.from_flat() got unknown settings: {sorted(unknown)}")
        parts = {name: comp(**{f.name: values[f.name] for f in fields(comp) if f.name in values})
                 for name, comp in COMPONENTS.items()}
        own = {f.name: values[f.name] for f in _run_fields() if f.name in values}
        return cls(**own, **parts)



def _run_fields():
    return [f for f in fields(TrainConfig) if f.name not in COMPONENTS]


# The flat settings in the order users see them: `--help`, config.json and a relaunch's argv.
FLAT_NAMES = ("model", "data", "epochs", "batch_size", "global_batch_size", "lr", "optimizer", "weight_decay",
              "scheduler", "step_size", "gamma", "precision", "strategy", "devices",
              "min_free_memory", "seed", "out", "image_size", "seq_length", "future_length",
              "accumulate", "clip_grad_norm", "drop_last", "bad_images", "decode", "workers",
              "cpu_placement", "find_unused_parameters", "fsdp_cpu_offload", "activation_checkpointing",
              "compile",
              "resume", "checkpoint_every", "keep", "logger", "log_every", "deterministic",
              "cudnn_benchmark")


def flat_fields() -> list:
    """The fields of TrainConfig and of its components, in FLAT_NAMES' order."""
    found = {f.name: f for comp in COMPONENTS.values() for f in fields(comp)}
    found.update((f.name, f) for f in _run_fields())
    return [found[name] for name in FLAT_NAMES]


def flatten(cfg: TrainConfig) -> dict:
    """The settings of `cfg` as one flat mapping (config.json's keys), in FLAT_NAMES' order."""
    values = {f.name: getattr(cfg, f.name) for f in _run_fields()}
    for name in COMPONENTS:
        part = getattr(cfg, name)
        values.update((f.name, getattr(part, f.name)) for f in fields(part))
    return {name: values[name] for name in FLAT_NAMES}


def flag_forms() -> dict[str, str]:
    """Each component's `Type.field` -> its flag (train/settings/flagwords.py): "{}" takes the value; a
    switch is said alone."""
    owners = [TrainConfig, *COMPONENTS.values()]
    return {f"{owner.__name__}.{f.name}": "--" + f.name.replace("_", "-")
            + ("" if f.type == "bool" else " {}")
            for owner in owners for f in fields(owner) if f.name in FLAT_NAMES}


# argparse type for each annotation
def int_or_auto(text: str) -> int | str:
    """--batch-size: a whole number, or "auto" (batchfit.py)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        value = float(text)
        if value.is_integer():
            return int(value)  # 64, and 64.0 or 1e2 from a YAML file
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number nor auto")


_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float,
          "str | None": str, "int | str": int_or_auto}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    for f in flat_fields():
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        default = None if f.default is MISSING else f.default
        if f.type == "bool":
            parser.add_argument(flag, action="store_true", default=default, help=meta["help"])
            continue
        kwargs = dict(type=_TYPES[f.type], default=default, choices=meta.get("choices"),
                      help=meta["help"] + ("" if default is None else f" (default: {default})"))
        if meta.get("const") is not None:
            kwargs.update(nargs="?", const=meta["const"])
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if f.default is MISSING:
            kwargs["required"] = True
        parser.add_argument(flag, **kwargs)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig.from_flat(**{name: getattr(args, name) for name in FLAT_NAMES})


def config_to_argv(cfg: TrainConfig) -> list[str]:
    """The command-line flags that rebuild `cfg` (used to relaunch the same job under torchrun)."""
    argv = []
    types = {f.name: f.type for f in flat_fields()}
    for name, value in flatten(cfg).items():
        flag = "--" + name.replace("_", "-")
        if types[name] == "bool":
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv
