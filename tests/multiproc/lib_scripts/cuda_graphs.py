"""compile_model(model, "reduce-overhead") under DDP on GPUs: CUDA graphs, the same training.

Two copies of the built-in cnn (it has BatchNorm, whose running statistics a graph must update)
train side by side on the same batches in fp32 through engine.train_step, the step of `multigpu
train`: one eager, one compiled in mode "reduce-overhead" (CUDA graphs). The batches include a
smaller last one (a new shape: recompiled and recorded once more), then both are evaluated.
Rank 0 prints one JSON line: the largest difference between the two models' weights and between
their BatchNorm statistics, the largest difference of the compiled model's weights between the
ranks, the eval losses, how many CUDA graphs torch recorded and how many graphs it left out of
CUDA graphs (it does so, with a warning, for graphs it cannot capture), and the world size.
"""
import json

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

import multigpu
from multigpu.train.engine import StepSettings, evaluate, train_step
from multigpu.train.models.catalog import build_model
from multigpu.train.settings.config import TrainConfig
from multigpu.train.training import ddp_options

rt = multigpu.setup("ddp", "fp32", accelerator="cuda", seed=0,
                    ddp=ddp_options(TrainConfig(model="cnn")))
torch.backends.cudnn.deterministic = True  # eager and compiled pick the same convolutions,
torch.backends.cudnn.allow_tf32 = False     # in full fp32: TF32 rounding would differ between
torch.backends.cuda.matmul.allow_tf32 = False  # the two orders of summation by ~1e-3
eager = build_model("cnn", (1, 8, 8), 10)
compiled = build_model("cnn", (1, 8, 8), 10)
compiled.load_state_dict(eager.state_dict())
eager = rt.prepare(eager)
compiled = multigpu.compile_model(rt.prepare(compiled), "reduce-overhead")
models = (eager, compiled)
opts = [torch.optim.SGD(rt.strategy.unwrap(m).parameters(), lr=0.05, momentum=0.9) for m in models]
settings = StepSettings()
g = torch.Generator().manual_seed(1 + rt.rank)
batches = [(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))
           for n in [32] * 8 + [7]]
for x, y in batches:
    for model, opt in zip(models, opts):
        model.train()
        train_step(rt, model, opt, F.cross_entropy, (x.to(rt.device), y.to(rt.device)), settings)
val = [(x.to(rt.device), y.to(rt.device)) for x, y in batches[:3]]
losses = [evaluate(rt, m, F.cross_entropy, val, True, settings)["val_loss"] for m in models]

plain = [rt.strategy.unwrap(m) for m in models]
weights = max((a - b).abs().max().item()
              for a, b in zip(plain[0].parameters(), plain[1].parameters()))
stats = max((a - b).abs().max().item() for a, b in zip(plain[0].buffers(), plain[1].buffers())
            if a.is_floating_point())
flat = torch.cat([p.detach().flatten() for p in plain[1].parameters()])
gathered = [torch.empty_like(flat) for _ in range(rt.world_size)]
if rt.world_size > 1:
    torch.distributed.all_gather(gathered, flat)
across = max((t - flat).abs().max().item() for t in gathered) if rt.world_size > 1 else 0.0
manager = cudagraph_trees.get_manager(rt.device.index, create_if_none_exists=False)
graphs = next(manager.graph_counter) if manager is not None else 0  # CUDA graphs recorded so far
if rt.is_main:
    print(json.dumps({"max_weight_diff": weights, "max_stats_diff": stats, "across_ranks": across,
                      "eval_losses": losses, "graphs": graphs,
                      "skips": counters["inductor"].get("cudagraph_skips", 0),
                      "world_size": rt.world_size}))
multigpu.destroy_distributed()
