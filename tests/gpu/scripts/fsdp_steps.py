"""fsdp's GPU path in one process: a one-rank NCCL group, so fully_shard runs on a mesh of one.

    python fsdp_steps.py MODEL PRECISION [offload,recompute]

What this exercises that the CPU tests cannot: NCCL collectives of FSDP2, the bf16/fp16
parameter policy (fp32 parameters for a model with BatchNorm), CUDA's fused AdamW on sharded
(DTensor) parameters with and without fp16 loss scaling, the whole-state gather onto the CPU and
loading it back. Trains 30 steps on one batch, saves, loads into a second prepared model,
compares the whole state and the evaluation loss of both, and prints one JSON line.
"""
import io
import json
import sys

import torch
import torch.distributed as dist

import multigpu
from multigpu.core.checkpoints.checkpoint import to_cpu
from multigpu.train.settings.config import TrainConfig
from multigpu.train.models.catalog import build_model
from multigpu.train.training import make_optimizer

name, precision = sys.argv[1], sys.argv[2]
extras = sys.argv[3].split(",") if len(sys.argv) > 3 else []
device = torch.device("cuda", 0)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
rt = multigpu.setup("fsdp", precision, options=multigpu.FSDPOptions(
    cpu_offload="offload" in extras, activation_checkpointing="recompute" in extras))
cfg = TrainConfig.from_flat(model=name, optimizer="adamw", lr=1e-3)


def prepared():
    torch.manual_seed(0)
    model = rt.prepare(build_model(name, (3, 64, 64), 10))
    return model, make_optimizer(cfg, model)  # fused AdamW, as multigpu train builds it


g = torch.Generator().manual_seed(1)
x = torch.randn(32, 3, 64, 64, generator=g).to(device)
y = torch.randint(0, 10, (32,), generator=g).to(device)


def step(model, optimizer) -> float:
    with rt.autocast():
        loss = torch.nn.functional.cross_entropy(model(x), y)
    rt.backward(loss)
    rt.step(optimizer, clip_grad_norm=1.0)
    return loss.item()


torch.cuda.reset_peak_memory_stats(device)
model, optimizer = prepared()
parameters_on = next(model.parameters()).device.type  # the shards' home (after a forward
# without a backward the root's parameters stay gathered on the GPU)
losses = [step(model, optimizer) for _ in range(30)]
state = rt.checkpoint_state(model, optimizer)
buffer = io.BytesIO()
torch.save(to_cpu(state), buffer)
buffer.seek(0)
saved = torch.load(buffer, weights_only=True)
again, again_optimizer = prepared()
rt.load(saved, model=again, optimizer=again_optimizer)
reloaded = rt.checkpoint_state(again, again_optimizer)
# all() of nothing is True: the states compared must be there, the same keys on both sides
same_weights = bool(saved["model"]) and saved["model"].keys() == reloaded["model"].keys() and all(
    torch.equal(saved["model"][k], reloaded["model"][k].cpu()) for k in saved["model"])
saved_states, reloaded_states = saved["optimizer"]["state"], reloaded["optimizer"]["state"]
same_optimizer = bool(saved_states) and saved_states.keys() == reloaded_states.keys() and all(
    state and state.keys() == reloaded_states[i].keys() and all(
        torch.equal(value, reloaded_states[i][key].cpu()) for key, value in state.items())
    for i, state in saved_states.items())


def eval_loss(net) -> float:  # eval mode: no dropout or stochastic depth drawing from the RNG
    net.eval()
    with torch.no_grad(), rt.autocast():
        return torch.nn.functional.cross_entropy(net(x), y).item()


next_loss, next_again = eval_loss(model), eval_loss(again)
print(json.dumps({
    "strategy": rt.strategy.describe(), "units": len(rt.strategy.units),
    "param_dtype": str(rt.strategy.param_dtype), "optimizer_fused": optimizer.defaults.get("fused"),
    "parameters_on": parameters_on, "parameters": len(list(model.parameters())),
    "optimizer_states": len(saved_states),
    "first_loss": losses[0], "last_loss": losses[-1], "skipped": rt.precision.skipped_steps,
    "same_weights_after_load": same_weights, "same_optimizer_after_load": same_optimizer,
    "eval_loss": next_loss, "eval_loss_reloaded": next_again,
    "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}))
dist.destroy_process_group()
