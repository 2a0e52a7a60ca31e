"""Each component's configuration checks its own values, in the library's words (said with the
flags by the command line); the flat flags and config.json are those of the flat TrainConfig
they replaced (tests/unit/data/train_flags.json was written by that code)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from multigpu.core.errors import UsageError
from multigpu.core.loggers import LoggingConfig
from multigpu.core.precision_config import PrecisionConfig
from multigpu.core.strategies.options import StrategyConfig
from multigpu.train.settings.checkpoint_config import CheckpointConfig
from multigpu.train.settings.config import (FLAT_NAMES, TrainConfig, add_config_arguments, config_from_args,
                                   config_to_argv, flatten)
from multigpu.train.data.data_config import DataConfig
from multigpu.train.settings.flagwords import say
from multigpu.train.settings.optim_config import OptimConfig

BEFORE = json.loads((Path(__file__).parent / "data" / "train_flags.json").read_text())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multigpu train")
    add_config_arguments(parser)
    return parser


def test_the_flags_are_those_of_the_flat_config():
    actions = [{"flags": a.option_strings, "dest": a.dest, "default": a.default, "help": a.help,
                "choices": list(a.choices) if a.choices else None, "metavar": a.metavar,
                "nargs": a.nargs, "const": a.const, "required": a.required,
                "type": getattr(a.type, "__name__", None)}
               for a in _parser()._actions if a.dest != "help"]
    assert actions == BEFORE["actions"]


@pytest.mark.parametrize("case", ["full", "minimal"])
def test_flags_to_config_json_and_back_to_argv_as_before(case):
    argv, config_json = BEFORE[case]["argv"], BEFORE[case]["config_json"]
    cfg = config_from_args(_parser().parse_args(argv))
    written = json.dumps(flatten(cfg))  # config.json's settings (training.resolved_config)
    assert json.loads(written) == config_json
    assert list(json.loads(written)) == list(config_json)  # and in the same order
    again = TrainConfig.from_flat(**json.loads(written))
    assert again == cfg
    assert config_to_argv(again) == BEFORE[case]["relaunch_argv"]
    assert config_from_args(_parser().parse_args(config_to_argv(again))) == cfg


def test_every_flat_setting_belongs_to_exactly_one_part():
    assert sorted(FLAT_NAMES) == sorted(BEFORE["full"]["config_json"])
    cfg = TrainConfig.from_flat(model="cnn", batch_size=8, lr=0.5, strategy="fsdp",
                                fsdp_cpu_offload=True, keep=2, log_every=5, precision="bf16")
    assert (cfg.input.batch_size, cfg.optim.lr, cfg.parallel.strategy, cfg.checkpointing.keep,
            cfg.logging.log_every, cfg.numerics.precision) == (8, 0.5, "fsdp", 2, 5, "bf16")
    with pytest.raises(TypeError, match=r"unknown settings: \['batch'\]"):
        TrainConfig.from_flat(model="cnn", batch=8)


def _refused(make) -> UsageError:
    with pytest.raises(UsageError) as caught:
        make()
    return caught.value


@pytest.mark.parametrize("make, library, command_line", [
    (lambda: StrategyConfig(strategy="ddp", fsdp_cpu_offload=True),
     "StrategyConfig(fsdp_cpu_offload=True) is an option of StrategyConfig(strategy='fsdp'), not "
     "of StrategyConfig(strategy='ddp'); add StrategyConfig(strategy='fsdp'), or leave it out",
     "--fsdp-cpu-offload is an option of --strategy fsdp, not of --strategy ddp; add --strategy "
     "fsdp, or leave it out"),
    (lambda: StrategyConfig(activation_checkpointing=True, fsdp_cpu_offload=True),
     "StrategyConfig(activation_checkpointing=True) is an option of StrategyConfig(strategy='fsdp'"
     "), not of StrategyConfig(strategy='auto'); add StrategyConfig(strategy='fsdp'), or leave it "
     "out",
     "--activation-checkpointing is an option of --strategy fsdp, not of --strategy auto; add "
     "--strategy fsdp, or leave it out"),
    (lambda: StrategyConfig(strategy="horovod"),
     "StrategyConfig(strategy='horovod') is not one of auto, single, dp, ddp, fsdp",
     "--strategy horovod is not one of auto, single, dp, ddp, fsdp"),
    (lambda: PrecisionConfig("fp8"), "PrecisionConfig(precision='fp8') is not one of auto, fp32, "
     "bf16, fp16", "--precision fp8 is not one of auto, fp32, bf16, fp16"),
    (lambda: DataConfig(batch_size=0), "DataConfig(batch_size=0) must be a number at least 1, "
     "e.g. DataConfig(batch_size=64)", "--batch-size 0 must be a number at least 1, e.g. "
     "--batch-size 64"),
    (lambda: DataConfig(workers=-1), "DataConfig(workers=-1) must be a number at least 0, e.g. "
     "DataConfig(workers=4)", "--workers -1 must be a number at least 0, e.g. --workers 4"),
    (lambda: DataConfig(data="synth"), "unknown data spec 'synth': use one of digits, "
     "synthetic:N (e.g. synthetic:5000), folder:PATH (ImageFolder layout), shards:DIR (WebDataset tar shards), "
     "timeseries:CSV", None),
    (lambda: OptimConfig(lr=0.0), "OptimConfig(lr=0.0) must be a number more than 0, e.g. "
     "OptimConfig(lr=0.001)", "--lr 0 must be a number more than 0, e.g. --lr 0.001"),
    (lambda: OptimConfig(clip_grad_norm=float("nan")), "OptimConfig(clip_grad_norm=nan) must be a "
     "number more than 0, e.g. OptimConfig(clip_grad_norm=1.0)", "--clip-grad-norm nan must be a "
     "number more than 0, e.g. --clip-grad-norm 1.0"),
    (lambda: OptimConfig(accumulate=0), "OptimConfig(accumulate=0) must be a number at least 1, "
     "e.g. OptimConfig(accumulate=1)", "--accumulate 0 must be a number at least 1, e.g. "
     "--accumulate 1"),
    (lambda: CheckpointConfig(checkpoint_every="5x"), "--checkpoint-every 5x: use a number of "
     "steps (500), a time (30s, 10m, 2h), or 0 for the end of each epoch only", None),
    (lambda: CheckpointConfig(keep=0), "CheckpointConfig(keep=0) must be a number at least 1, "
     "e.g. CheckpointConfig(keep=1)", "--keep 0 must be a number at least 1, e.g. --keep 1"),
    (lambda: LoggingConfig(logger="tb"), "LoggingConfig(logger='tb'): 'tb' is not a logger; use "
     "any of tensorboard, csv, mlflow, wandb (comma-separated), or none", "--logger tb: 'tb' is "
     "not a logger; use any of tensorboard, csv, mlflow, wandb (comma-separated), or none"),
    (lambda: LoggingConfig(log_every=0), "LoggingConfig(log_every=0) must be a number at least 1, "
     "e.g. LoggingConfig(log_every=1)", "--log-every 0 must be a number at least 1, e.g. "
     "--log-every 1"),
    (lambda: TrainConfig(model="mlp", epochs=0), "TrainConfig(epochs=0) must be a number at least "
     "1, e.g. TrainConfig(epochs=1)", "--epochs 0 must be a number at least 1, e.g. --epochs 1"),
    (lambda: TrainConfig(model="resnet19"), "unknown model 'resnet19': choose one of linear, mlp, "
     "cnn, resnet18, resnet50, vgg16, swin_t, lstm, tst or torchvision:NAME / timm:NAME", None),
    (lambda: TrainConfig(model="lstm"), "data 'digits' is not a time series, which sequence "
     "models (lstm, tst) need: use --data timeseries:co2, timeseries:macro or timeseries:CSV, or "
     "another --model for this data", None),
])
def test_each_part_refuses_its_own_bad_values(make, library, command_line):
    refused = _refused(make)
    assert str(refused) == library
    assert say(refused) == (command_line or library)


def test_the_parts_take_their_good_values():
    assert StrategyConfig(strategy="fsdp", fsdp_cpu_offload=True, activation_checkpointing=True)
    assert DataConfig(batch_size="auto", workers=0, data="synthetic:100")
    assert CheckpointConfig(checkpoint_every="500").cadence().steps == 500
    assert CheckpointConfig(checkpoint_every="2h").cadence().seconds == 7200
    assert OptimConfig(optimizer="sgd").learning_rate == 0.05
    assert OptimConfig(lr=0.2).learning_rate == 0.2
    assert LoggingConfig(logger="none").names == ()
    assert TrainConfig(model="lstm", input=DataConfig(data="timeseries:co2")).input.data


@pytest.mark.parametrize("argv, said", [
    (["--lr", "0"], "--lr 0 must be a number more than 0, e.g. --lr 0.001"),
    (["--strategy", "ddp", "--fsdp-cpu-offload"], "--fsdp-cpu-offload is an option of --strategy "
     "fsdp, not of --strategy ddp; add --strategy fsdp, or leave it out"),
    (["--min-free-memory", "-1"], "--min-free-memory -1 must be a number at least 0, e.g. "
     "--min-free-memory 2"),
])
def test_the_command_line_says_them_with_its_flags(argv, said, capsys, tmp_path):
    from multigpu import cli

    assert cli.main(["train", "--model", "mlp", "--out", str(tmp_path / "x"), *argv]) == 2
    assert capsys.readouterr().err == f"multigpu: error: {said}\n"
    assert not (tmp_path / "x").exists()
