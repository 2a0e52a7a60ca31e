"""pytorch/examples' FSDP2 script (distributed/FSDP2/example.py), converted to multigpu: a small
decoder-only transformer whose blocks are sharded over the processes with FSDP2, trained on
random tokens, saved and resumed. What changed:

    pytorch/examples                                  multigpu
    init_process_group(backend, device_id=device)     rt = multigpu.setup("fsdp", precision)
    for layer in model.layers: fully_shard(layer)     FSDPOptions(shard_modules=(Block,))
    fully_shard(model)                                model = rt.prepare(model)  (root, then
                                                      rank 0's weights on every rank first)
    MixedPrecisionPolicy(param_dtype=bfloat16,        --precision bf16: the same policy, autocast
                         reduce_dtype=float32)        around the loss
    optim = Adam(model.parameters()) after sharding   rt.prepare(model, lambda ps: Adam(ps)):
                                                      an optimizer built before sharding is refused
    loss.backward(); clip_grad_norm_(...);            rt.backward(loss); rt.step(optim,
    optim.step(); optim.zero_grad()                   clip_grad_norm=1.0)
    DCP save/load of get_state_dict(model, optim)     rt.save(path, model=, optimizer=) gathers one
                                                      file on rank 0 (loads into a bare module too);
                                                      rt.load(path, ...) on any number of processes

    python examples/fsdp_transformer.py                               # one process: not sharded
    multigpu run --devices cpu:2 examples/fsdp_transformer.py         # 2 CPU processes (gloo)
    multigpu run --devices 2 examples/fsdp_transformer.py --precision bf16
    multigpu run --devices 3 examples/fsdp_transformer.py --resume ckpt.pt   # any count

Prints the strategy, the loss of each step window, and where it saved.
"""
import argparse
import math

import torch
from torch import nn

import multigpu

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--layers", type=int, default=6)
parser.add_argument("--width", type=int, default=128)
parser.add_argument("--vocab", type=int, default=512)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=8, help="sequences per process")
parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
parser.add_argument("--save", default="fsdp_transformer.pt")
parser.add_argument("--resume", help="a checkpoint this script saved, on any number of processes")
args = parser.parse_args()


class Block(nn.Module):
    """Pre-norm self-attention (causal) and MLP: the unit FSDP2 gathers and frees as one."""

    def __init__(self, width: int, heads: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, seq_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(seq_len, width) / math.sqrt(width))
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        n = tokens.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=tokens.device), diagonal=1)
        x = self.tokens(tokens) + self.positions[:n]
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(self.norm(x))


rt = multigpu.setup("fsdp", args.precision, seed=0,
                    options=multigpu.FSDPOptions(shard_modules=(Block,)))
model = TinyLM(args.vocab, args.width, args.layers, args.seq_len)
model, optimizer = rt.prepare(model, lambda params: torch.optim.Adam(params, lr=3e-3))
rt.print(f"strategy: {rt.strategy.describe()}")
start = 0
if args.resume:
    start = rt.load(args.resume, model=model, optimizer=optimizer)["steps_done"]
    rt.print(f"resumed from {args.resume} after step {start}")

# A learnable toy task: each sequence counts up from a random token (mod vocab), so the next
# token follows from the current one. Every rank draws its own batches.
g = torch.Generator().manual_seed(1000 + rt.rank)
window = []
for step in range(start, start + args.steps):
    first = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    tokens = ((first + torch.arange(args.seq_len + 1)) % args.vocab).to(rt.device)
    with rt.autocast():
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    rt.backward(loss)
    rt.step(optimizer, clip_grad_norm=1.0)
    window.append(loss.detach())
    if (step + 1) % 10 == 0:
        mean = rt.env.all_reduce(torch.stack(window).mean().reshape(1)) / rt.world_size
        rt.print(f"step {step + 1}: loss {mean.item():.4f}")
        window = []
rt.save(args.save, model=model, optimizer=optimizer, steps_done=start + args.steps)
rt.print(f"saved {args.save}")
