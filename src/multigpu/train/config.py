"""The settings of `multigpu train`, as one dataclass.

Each field's `help` is its `--help` text, and the parser is built from the fields, so a flag, its
default and its documentation can never drift apart. The resolved config is written to
`config.json` in the run folder.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields

from multigpu.core.compiling import TRAIN_MODES as COMPILE_MODES
from multigpu.core.strategies.registry import HELP as STRATEGY_HELP
from multigpu.core.strategies.registry import NAMES as STRATEGY_NAMES

DECODE_CHOICES = ("auto", "cpu", "gpu")  # --decode (imagefolder.use_decode)


def _f(default, help: str, choices=None, metavar=None, const=None):
    """A field; with `const`, its flag may be given alone and then means `const`."""
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar,
                                            "const": const})


@dataclass
class TrainConfig:
    model: str = _f(MISSING, "built-in model (linear, mlp, cnn, resnet18, resnet50, vgg16, swin_t; lstm, tst for timeseries:), "
                             "or torchvision:NAME / timm:NAME when installed")
    data: str = _f("digits", "digits | synthetic:N | folder:PATH (train/ and val/ inside) | "
                             "timeseries:CSV | timeseries:co2 | timeseries:macro (embedded)")
    epochs: int = _f(10, "passes over the training set")
    batch_size: int | str = _f(64, "samples per device per step (the global batch is this times "
                                   "the number of GPUs or processes), or auto: the largest that "
                                   "fits on every GPU, found by real steps at the start",
                               metavar="N|auto")
    lr: float | None = _f(None, "learning rate (default: 0.05 for sgd, 1e-3 for adam/adamw)")
    optimizer: str = _f("adamw", "optimizer", choices=("sgd", "adam", "adamw"))
    weight_decay: float = _f(0.0, "weight decay")
    scheduler: str = _f("none", "learning-rate schedule, stepped once per epoch",
                        choices=("none", "step", "cosine"))
    step_size: int = _f(5, "--scheduler step: epochs between decays (post 001 used 5)")
    gamma: float = _f(0.9, "--scheduler step: decay factor (post 001 used 0.9)")
    precision: str = _f("auto", "fp32 | bf16 | fp16 (with loss scaling) | auto (bf16 on GPUs that "
                                "support it, else fp32; fp32 for lstm and tst)", choices=("auto", "fp32", "bf16", "fp16"))
    strategy: str = _f("auto", STRATEGY_HELP, choices=STRATEGY_NAMES)
    devices: str = _f("auto", "auto (all free GPUs, or 1 CPU process) | N (N free GPUs) | 0,3 "
                              "(those GPU ids) | cpu:N (N CPU processes on gloo)")
    min_free_memory: float = _f(2.0, "GiB a GPU must have free for --devices auto|N to take it")
    seed: int = _f(0, "seed for weights, data order and augmentation (identical on every rank)")
    out: str | None = _f(None, "run folder (default: a new runs/<time>-<model>-<data>/); never "
                               "overwritten")
    image_size: int | None = _f(None, "image side for synthetic and folder data (default: the "
                                      "model's own, e.g. 224 for resnet50)")
    seq_length: int = _f(12, "timeseries: history length of each window")
    future_length: int = _f(1, "timeseries: horizon predicted by each window")
    accumulate: int = _f(1, "micro-batches per optimizer step (gradients all-reduced on the last only)")
    clip_grad_norm: float | None = _f(None, "clip the global gradient norm to this value")
    drop_last: bool = _f(False, "drop the last partial step of each epoch instead of training on it")
    bad_images: str = _f("skip", "folder: data, an image that cannot be decoded: skip (the next "
                                 "readable image takes its place, it is named and counted; the "
                                 "run stops if over 1 %% of an epoch's images are bad) or fail",
                         choices=("skip", "fail"))
    decode: str = _f("auto", "folder: data, where JPEGs are decoded: gpu (nvJPEG through "
                             "torchvision, the crops on the GPU too, overlapped with the step), "
                             "cpu (in the loader workers), auto (the workers alone when there are "
                             "15 or more per GPU, else both, sharing each batch)",
                     choices=DECODE_CHOICES)
    workers: int | None = _f(None, "DataLoader worker processes per rank (default: 0 for in-memory "
                                   "data, else the CPU cores per GPU)")
    find_unused_parameters: bool = _f(False, "let DDP search for parameters the loss does not use "
                                             "(slower; the default reports them by name instead)")
    fsdp_cpu_offload: bool = _f(False, "--strategy fsdp: keep the shards of parameters, gradients "
                                       "and optimizer state in host memory (the optimizer steps "
                                       "on the CPU): for models whose shards do not fit the GPUs")
    activation_checkpointing: bool = _f(False, "--strategy fsdp: recompute each block's "
                                               "activations in the backward instead of keeping "
                                               "them (about 1/3 more compute, much less memory)")
    compile: str | None = _f(None, "torch.compile the model in MODE: default (--compile alone), "
                                   "reduce-overhead (CUDA graphs: a step's kernels launched at "
                                   "once; much faster small batches, GPUs only), max-autotune, "
                                   "max-autotune-no-cudagraphs, or auto (CUDA graphs where they "
                                   "work and the run is long enough to win back compiling; "
                                   "compiled code is cached in ~/.cache/multigpu/torch-compile)",
                             choices=COMPILE_MODES, metavar="MODE", const="default")
    resume: str | None = _f(None, "continue from a checkpoint file or a run folder (its newest "
                                  "readable checkpoint), from any strategy or device count, inside "
                                  "an epoch too; the run goes on in that folder unless --out is "
                                  "given (running the same command again continues in --out)")
    checkpoint_every: str = _f("10m", "also checkpoint inside epochs: every N steps (500), or "
                                      "every so long (30s, 10m, 2h); 0: at the end of each epoch "
                                      "only", metavar="N|TIME")
    keep: int = _f(3, "checkpoints kept: the N newest, plus best.pt")
    logger: str = _f("tensorboard,csv", "where the numbers go besides metrics.jsonl: any of "
                                        "tensorboard, csv, mlflow, wandb (comma-separated; mlflow "
                                        "and wandb stay local), or none", metavar="LIST")
    log_every: int = _f(50, "log the training loss, learning rate and speed every N steps")
    deterministic: bool = _f(False, "deterministic kernels (cuDNN, torch.use_deterministic_"
                                    "algorithms): an interrupted and resumed run ends with the "
                                    "same weights as an uninterrupted one, bit for bit")


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


def add_config_arguments(parser: argparse.ArgumentParser, cls=TrainConfig) -> None:
    for f in fields(cls):
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


def config_from_args(args: argparse.Namespace, cls=TrainConfig) -> TrainConfig:
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def config_to_argv(cfg: TrainConfig) -> list[str]:
    """The command-line flags that rebuild `cfg` (used to relaunch the same job under torchrun)."""
    argv = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv

