"""The strategy registry (the one list of names and what each allows) and fsdp's pure parts:
which modules become shard units, and the optimizer state's two layouts."""
import argparse
import re

import pytest
import torch
from torch import nn

from multigpu.core import compiling
from multigpu.cli import strategy_checks
from multigpu.train.settings.config import add_config_arguments
from multigpu.core.errors import UsageError
from multigpu.train.settings.flagwords import say
from multigpu.train.models.catalog import build_model
from multigpu.core.strategies import STRATEGIES, registry
from multigpu.core.checkpoints.checkpoint import named_optimizer_state, numbered_optimizer_state
from multigpu.core.strategies.fsdp import FSDPOptions, shard_units


def test_every_registered_strategy_loads_its_class_under_its_name_and_is_offered_by_train():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    for name, info in STRATEGIES.items():
        assert info.load().name == name
        assert f"{name} ({info.help.split()[0]}" in help_text
    assert registry.NAMES == ("auto", "single", "dp", "ddp", "fsdp")


def test_plans_a_strategy_cannot_run_are_refused_with_the_fix():
    with pytest.raises(UsageError, match="--strategy single uses one device, but --devices 0,1 "
                                         "gives 2; pass --devices 1"):
        strategy_checks.check_device_count("single", "0,1", "cuda", 2, 1)
    with pytest.raises(UsageError, match="--strategy dp .* needs GPUs; on CPU use --strategy ddp"):
        strategy_checks.check_accelerator("dp", "cpu")
    with pytest.raises(UsageError, match="--batch-size auto measures with real steps of the whole "
                                         "model on one GPU, and --strategy fsdp shares it out over "
                                         "all; give a number"):
        strategy_checks.check_accelerator("fsdp", "cuda", auto_batch=True)
    strategy_checks.check_device_count("fsdp", "cpu:3", "cpu", 0, 3)
    strategy_checks.check_accelerator("fsdp", "cpu")
    with pytest.raises(UsageError) as caught:
        compiling.check("reduce-overhead", "cuda", "fsdp")
    assert re.match("--compile reduce-overhead records CUDA graphs, which --strategy fsdp cannot "
                    "use .*: use --strategy ddp, or --compile default", say(caught.value))
    with pytest.raises(UsageError, match="unknown strategy 'zero3'"):
        registry.info("zero3")


def _names(model, units):
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(u)] for u in units]


@pytest.mark.parametrize("model_name, blocks", [("resnet50", 16), ("swin_t", None)])
def test_the_blocks_of_the_built_in_models_become_shard_units(model_name, blocks):
    model = build_model(model_name, (3, 64, 64), 10)
    units = shard_units(model, FSDPOptions())
    inside = sum(p.numel() for u in units for p in u.parameters())
    assert inside / sum(p.numel() for p in model.parameters()) > 0.98  # the root keeps little
    ids = [id(m) for u in units for m in u.modules()]
    assert len(ids) == len(set(ids))  # no unit inside another
    if blocks:  # resnet50: the bottlenecks of stages 1-3 (stage 0's have < 100k parameters)
        assert _names(model, units) == [f"stages.{s}.{b}" for s, n in ((1, 4), (2, 6), (3, 3))
                                        for b in range(n)]
        assert len(units) == blocks - 3


def test_shard_modules_names_the_classes_and_only_the_outermost_are_units():
    class Inner(nn.Linear):
        pass

    model = nn.Sequential(nn.Sequential(Inner(4, 4), nn.ReLU()), Inner(4, 4))
    assert _names(model, shard_units(model, FSDPOptions(shard_modules=(Inner,)))) == ["0.0", "1"]
    assert _names(model, shard_units(model, FSDPOptions(shard_modules=(nn.Sequential, Inner)))) \
        == ["0", "1"]
    assert shard_units(model, FSDPOptions()) == []  # 20 parameters each: below min_params


def test_a_module_sharing_a_parameter_outside_it_is_never_a_shard_unit():
    embed, head = nn.Embedding(50, 64), nn.Linear(64, 50, bias=False)
    head.weight = embed.weight  # tied input and output weights
    model = nn.Sequential(embed, nn.Linear(64, 64), head)
    assert _names(model, shard_units(model, FSDPOptions(min_params=10))) == ["1"]
    with pytest.raises(UsageError, match="names Linear, but one of them shares a parameter with "
                                         "0.weight outside it"):
        shard_units(model, FSDPOptions(shard_modules=(nn.Linear,)))


def test_optimizer_state_by_name_and_by_number_convert_both_ways():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    optimizer = torch.optim.AdamW([{"params": [model[1].weight]},
                                   {"params": [model[0].weight, model[0].bias, model[1].bias],
                                    "lr": 0.1}])
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    numbered = optimizer.state_dict()
    order = ["1.weight", "0.weight", "0.bias", "1.bias"]  # the optimizer's order, by name
    named = named_optimizer_state(numbered, order)
    assert [g["params"] for g in named["param_groups"]] == [["1.weight"],
                                                            ["0.weight", "0.bias", "1.bias"]]
    assert torch.equal(named["state"]["0.bias"]["exp_avg"], numbered["state"][2]["exp_avg"])
    again = numbered_optimizer_state(named)
    assert again["param_groups"] == numbered["param_groups"]
    assert again["state"].keys() == numbered["state"].keys()
    for i, state in numbered["state"].items():
        assert all(torch.equal(state[k], again["state"][i][k]) for k in state)


def test_convnets_train_channels_last_on_gpus_except_under_fsdp():
    from types import SimpleNamespace

    from multigpu.train.training import uses_channels_last

    def rt(device, strategy):
        return SimpleNamespace(device=torch.device(device), strategy=SimpleNamespace(name=strategy))
    assert [uses_channels_last(rt("cuda", s), "resnet50") for s in STRATEGIES] == [True, True, True, False]
    assert list(STRATEGIES) == ["single", "dp", "ddp", "fsdp"]
    assert not uses_channels_last(rt("cpu", "ddp"), "resnet50")
    assert not uses_channels_last(rt("cuda", "ddp"), "mlp")


def test_fsdp_in_one_cpu_process_says_how_to_shard_without_offering_gpu_offload(capsys):
    import multigpu

    rt = multigpu.setup("fsdp", accelerator="cpu", seed=0)
    rt.prepare(nn.Linear(3, 2))
    err = capsys.readouterr().err
    assert ("strategy 'fsdp' in one process has nothing to shard the model over: it trains as "
            "setup(strategy='single') would; launch several processes (`multigpu run --devices 2`, "
            "or cpu:2) to shard it\n") in err
    assert "--fsdp-cpu-offload" not in err  # refused on CPUs: not a fix there
