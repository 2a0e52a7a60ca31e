"""`multigpu train`'s flags, built from TrainConfig's fields."""
import argparse

from multigpu.train.settings.config import TrainConfig, add_config_arguments, config_from_args, config_to_argv


def parse(*argv: str) -> TrainConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(["--model", "cnn", *argv]))


def test_compile_alone_is_the_default_mode_and_takes_a_mode():
    assert parse().compile is None
    assert parse("--compile").compile == "default"
    assert parse("--compile", "--epochs", "2").compile == "default"
    assert parse("--compile", "reduce-overhead").compile == "reduce-overhead"


def test_the_argv_of_a_config_rebuilds_it():  # how a job is relaunched under torch.distributed.run
    for cfg in (parse("--compile", "reduce-overhead", "--drop-last", "--lr", "0.2"), parse()):
        assert parse(*config_to_argv(cfg)[2:]) == cfg  # [2:]: past "--model cnn"
