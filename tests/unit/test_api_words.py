"""The library speaks its own API in its errors; the commands say the same message with flags.

Each mistake is caused for real (a strategy in the wrong world, a model with an unused
parameter, ...); the library's message must name the call to make and no flag, and
flagwords.say (what `multigpu train`, bench and doctor print) must name the flag.
"""
from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from multigpu.core import console
from multigpu.core.distributed import DistEnv
from multigpu.core.errors import Api, Text, UsageError
from multigpu.train.settings.flagwords import FLAGS, say
from tests.unit.test_doctor_setup import _HalfUsed

SRC = Path(__file__).resolve().parents[2] / "src" / "multigpu" / "core"  # the library


def flags_in(text: str) -> list[str]:
    """The flags a message names outside a command in backticks (`multigpu run --devices N`,
    which a library user types too)."""
    return re.findall(r"(?<![\w-])--[a-z][a-z-]*", re.sub(r"`[^`]*`", "", text))


def refused(make) -> UsageError:
    with pytest.raises(UsageError) as caught:
        make()
    return caught.value


def test_an_api_name_is_python_for_the_library_and_its_flag_for_the_command_line():
    text = Text("use {} with a larger {}, or {}", Api("setup.accumulate", 1),
                Api("DataLoader.batch_size", text="batch_size"), Api("my.thing", "x"))
    assert text == "use setup(accumulate=1) with a larger batch_size, or my(thing='x')"
    assert say(UsageError(text)) == "use --accumulate 1 with a larger --batch-size, or my(thing='x')"
    assert say(UsageError("no names: said as it is")) == "no names: said as it is"
    assert say(UsageError(Text("braces {as} they are"))) == "braces {as} they are"
    # a rank's error goes to the others pickled (trainloop._on_rank0): its names go with it
    again = pickle.loads(pickle.dumps(UsageError(text)))
    assert str(again) == str(text) and say(again) == say(UsageError(text))


@pytest.mark.parametrize("make, library, cli", [
    (lambda: _strategy("single").create(DistEnv(world_size=2)),
     "use setup(strategy='ddp') (or auto), or launch one process",
     "use --strategy ddp (or auto), or launch one process"),
    (lambda: _strategy("dp")(DistEnv(world_size=2), (0,)),
     "use setup(strategy='ddp') with a launcher, or setup(strategy='dp') without one",
     "use --strategy ddp with a launcher, or --strategy dp without one"),
    (lambda: _strategy("dp").create(DistEnv()),
     "on CPU use setup(strategy='single') or setup(strategy='ddp') with `multigpu run --devices cpu:N`",
     "on CPU use --strategy single or --strategy ddp with --devices cpu:N"),
    (lambda: _fsdp_offload_on_cpu(),
     "CPU processes keep everything there already: leave FSDPOptions(cpu_offload=True) out",
     "CPU processes keep everything there already: leave --fsdp-cpu-offload out"),
    (lambda: _half_used_backward(),
     "freeze it (requires_grad_(False)), or pass setup(ddp=DDPOptions(find_unused_parameters=True))",
     "freeze it (requires_grad_(False)), or pass --find-unused-parameters"),
    (lambda: _precision_without_bf16(),
     "GPU Tesla V100-SXM2-32GB has no bf16; use setup(precision='fp16') (or fp32)",
     "GPU Tesla V100-SXM2-32GB has no bf16; use --precision fp16 (or fp32)"),
    (lambda: _cuda_without_gpus(),
     "no GPU is visible to this process; use setup(accelerator='cpu'), or check `multigpu gpus`",
     "no GPU is visible to this process; use --devices cpu:N, or check `multigpu gpus`"),
    (lambda: _no_step_left(),
     "one step takes 8; lower the DataLoader's batch_size or keep the last batch",
     "one step takes 8; lower --batch-size or keep the last batch"),
])
def test_a_library_error_names_the_api_and_the_command_line_the_flag(make, library, cli):
    error = refused(make)
    assert str(error).endswith(library) and not flags_in(str(error)), str(error)
    assert say(error).endswith(cli), say(error)


def test_a_model_already_wrapped_is_refused_naming_setup_not_a_flag():
    import multigpu

    rt = multigpu.setup("single", accelerator="cpu")
    error = refused(lambda: rt.prepare(nn.DataParallel(nn.Linear(2, 2))))
    assert str(error).endswith("let the strategy wrap it (setup(strategy='dp') or 'ddp')")


def test_a_library_warning_is_said_with_flags_where_the_command_line_asks_for_it(capsys):
    import multigpu

    rt = multigpu.setup("fsdp", accelerator="cpu")
    rt.prepare(nn.Linear(3, 2))
    assert "it trains as setup(strategy='single') would" in capsys.readouterr().err
    console.configure(True, say=say)  # what multigpu train's processes do
    try:
        rt.prepare(nn.Linear(3, 2))
    finally:
        console.configure(True, say=str)
    assert ("it trains as --strategy single would; launch several processes (--devices 2, or "
            "cpu:2) to shard it\n") in capsys.readouterr().err


def test_no_message_of_the_library_names_a_flag():
    """The core's errors and warnings (the arguments of UsageError, Text, warn) hold no flag;
    `multigpu run --devices N`, a command in backticks, is what a library user types too."""
    core = ["runtime.py", "checkpoints/runtime_checkpoints.py", "distributed.py", "precision.py",
            "loading/data.py", "loading/loaders.py", "metrics.py", "guards.py", "compiling.py",
            *(f"strategies/{p.name}" for p in (SRC / "strategies").glob("*.py"))]
    found = []
    for name in core:
        tree = ast.parse((SRC / name).read_text())
        for call in ast.walk(tree):
            func = getattr(call, "func", None)
            called = getattr(func, "id", None) or getattr(func, "attr", None)
            if not isinstance(call, ast.Call) or called not in ("UsageError", "Text", "warn"):
                continue
            text = "".join(node.value for node in ast.walk(call)
                           if isinstance(node, ast.Constant) and isinstance(node.value, str))
            found += [f"{name}:{call.lineno}: {flag}" for flag in flags_in(text)]
    assert found == []


def test_every_flag_of_the_table_is_one_that_multigpu_train_takes():
    import argparse

    from multigpu.train.settings.config import add_config_arguments

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = {f.split()[0] for f in FLAGS.values()}
    assert flags <= set(parser._option_string_actions), flags - set(parser._option_string_actions)


# --- the mistakes -------------------------------------------------------------------------------

def _strategy(name: str):
    from multigpu.core.strategies import registry

    return registry.info(name).load()


def _fsdp_offload_on_cpu():
    from multigpu.core.strategies import FSDPOptions

    _strategy("fsdp").create(DistEnv(), options=FSDPOptions(cpu_offload=True))


def _half_used_backward():
    from multigpu.core.strategies.ddp import DDP

    model = _HalfUsed()
    model(torch.randn(3, 4)).sum().backward()
    DDP(DistEnv(world_size=2)).check_unused([model])  # as rt.backward does after the first one


def _precision_without_bf16():
    from unittest import mock

    from multigpu.core.precision import Precision

    with mock.patch("torch.cuda.is_bf16_supported", return_value=False), \
            mock.patch("torch.cuda.get_device_name", return_value="Tesla V100-SXM2-32GB"):
        Precision("bf16", torch.device("cuda", 0))


def _cuda_without_gpus():
    from multigpu.core.distributed import _resolve_accelerator

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    _resolve_accelerator("cuda")


def _no_step_left():
    from multigpu.core.loading.data import plan_global_steps

    plan_global_steps(3, 8, 1, drop_last=True)
