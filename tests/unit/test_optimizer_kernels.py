"""Which kernel each --optimizer steps with under each strategy: fused on GPUs, except where the
parameters are DTensors (fsdp) and torch has no sharding rule for the fused op (SGD's).

CUDA's fused kernels cannot run here, but torch has CPU fused kernels behind the same ops, and
DTensor dispatches them through the same sharding rules: the GPU's choice of kernel is stepped
here on real fsdp-sharded parameters, which is where `aten._fused_sgd_.default does not have a
sharding strategy registered` came from on GPUs.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from multigpu.train import training
from multigpu.train.settings.config import TrainConfig
from multigpu.train.settings.optim_config import OptimConfig

FUSED, FOREACH = {"fused": True}, {"foreach": True}
# strategy -> whether its prepared parameters are DTensors (fsdp shards them; the others keep
# plain tensors, dp's replicas are made from them at each forward)
SHARDED = {"single": False, "dp": False, "ddp": False, "fsdp": True}


def test_the_offered_optimizers_are_the_ones_built():
    choices = {f.name: f for f in dataclasses.fields(OptimConfig)}["optimizer"].metadata["choices"]
    assert set(choices) == set(training.OPTIMIZERS)


@pytest.mark.parametrize("strategy", SHARDED)
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_each_optimizer_under_each_strategy_gets_a_kernel_its_parameters_can_run(strategy, optimizer):
    on_gpu = training.kernel_options(optimizer, "cuda", SHARDED[strategy])
    expected = FOREACH if (strategy, optimizer) == ("fsdp", "sgd") else FUSED
    assert on_gpu == expected
    # CPU processes, and fsdp's CPU offload (its shards live on the CPU): foreach
    assert training.kernel_options(optimizer, "cpu", SHARDED[strategy]) == FOREACH


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_the_gpu_choice_steps_on_sharded_parameters(one_rank_group, optimizer):
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model)
    params = list(model.parameters())
    assert training.holds_dtensors(params)
    kernel = training.kernel_options(optimizer, "cuda", training.holds_dtensors(params))
    step = training.OPTIMIZERS[optimizer](params, lr=0.1, **kernel)
    before = [p.full_tensor().clone() for p in params]
    model(torch.randn(3, 4)).sum().backward()
    step.step()
    assert all(not torch.equal(b, p.full_tensor()) for b, p in zip(before, params))


def test_make_optimizer_reads_plain_parameters_as_unsharded():
    model = nn.Linear(4, 2)
    assert not training.holds_dtensors(list(model.parameters()))
    optimizer = training.make_optimizer(TrainConfig.from_flat(model="mlp", optimizer="sgd"), model)
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults.get("fused")
