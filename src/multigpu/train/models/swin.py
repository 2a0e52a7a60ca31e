"""Swin-T (Swin Transformer, tiny): shifted-window self-attention with a relative position bias.

Patch size 4, window 7, embedding width 96, depths (2, 2, 6, 2), heads (3, 6, 12, 24), MLP ratio 4,
stochastic depth rising linearly to 0.2. With (3, 224, 224) inputs and 1000 outputs it has
28 288 354 parameters, as the reference model does.

Any image size of 4 pixels or more works. Like the reference, each block pads its feature map at the
bottom and right up to a multiple of the window size and does not shift windows along a side that
fits in one window; patch merging pads odd sizes by one. So at 32x32 the first stage attends over
8x8 tokens padded to 14x14, and the later stages see a single (mostly padded) window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EMBED_DIM = 96
DEPTHS = (2, 2, 6, 2)
HEADS = (3, 6, 12, 24)
WINDOW = 7
PATCH = 4
STOCHASTIC_DEPTH = 0.2


def _to_windows(x: torch.Tensor, window: int) -> torch.Tensor:
    """(B, H, W, C) -> (B * windows, window * window, C); H and W are multiples of `window`."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // window, window, w // window, window, c).transpose(2, 3)
    return x.reshape(-1, window * window, c)


def _from_windows(x: torch.Tensor, batch: int, h: int, w: int, window: int) -> torch.Tensor:
    """The inverse of `_to_windows`."""
    x = x.view(batch, h // window, w // window, window, window, -1).transpose(2, 3)
    return x.reshape(batch, h, w, -1)


def _bands(size: int, window: int, shift: int) -> list[tuple[int, int]]:
    # After a cyclic shift, the last `shift` rows (or columns) came from the other edge of the image.
    if shift == 0:
        return [(0, size)]
    return [(0, size - window), (size - window, size - shift), (size - shift, size)]


def _shift_mask(h: int, w: int, window: int, shift: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Additive mask (windows, N, N) that stops tokens from attending across a wrap-around seam."""
    region = torch.zeros(h, w, device=device)
    label = 0
    for top, bottom in _bands(h, window, shift[0]):
        for left, right in _bands(w, window, shift[1]):
            region[top:bottom, left:right] = label
            label += 1
    ids = _to_windows(region[None, :, :, None], window).squeeze(-1)
    different = ids[:, :, None] != ids[:, None, :]
    return different.float() * -100.0  # large enough to zero the softmax weight, small enough for fp16


class WindowAttention(nn.Module):
    """Multi-head self-attention inside non-overlapping windows, optionally cyclically shifted."""

    def __init__(self, dim: int, heads: int, window: int) -> None:
        super().__init__()
        self.heads, self.window = heads, window
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        span = 2 * window - 1
        self.relative_bias = nn.Parameter(torch.empty(span * span, heads))
        nn.init.trunc_normal_(self.relative_bias, std=0.02)
        # For each pair (query, key) of positions in a window: the row of `relative_bias` for their offset.
        ys, xs = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
        ys, xs = ys.flatten(), xs.flatten()
        dy = ys[:, None] - ys[None, :] + window - 1
        dx = xs[:, None] - xs[None, :] + window - 1
        self.register_buffer("bias_index", dy * span + dx, persistent=False)

    def forward(self, x: torch.Tensor, shift: tuple[int, int]) -> torch.Tensor:
        """x: (B, H, W, C) with H and W multiples of the window."""
        batch, h, w, dim = x.shape
        if any(shift):
            x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
        tokens = _to_windows(x, self.window)
        n = tokens.shape[1]
        q, k, v = self.qkv(tokens).view(-1, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q * self.scale) @ k.transpose(-2, -1)  # (B * windows, heads, N, N)
        scores = scores + self.relative_bias[self.bias_index].permute(2, 0, 1)
        if any(shift):
            mask = _shift_mask(h, w, self.window, shift, x.device).to(scores.dtype)
            scores = (scores.view(batch, -1, self.heads, n, n) + mask[None, :, None]).view(-1, self.heads, n, n)
        out = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(-1, n, dim)
        x = _from_windows(self.proj(out), batch, h, w, self.window)
        if any(shift):
            x = torch.roll(x, shifts=shift, dims=(1, 2))
        return x


def _drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: drop a residual branch for whole samples. Multiplying (not skipping) keeps every
    parameter in the graph, which DDP needs."""
    if not training or p == 0.0:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - p)
    return x * keep / (1.0 - p)


class SwinBlock(nn.Module):
    """LayerNorm -> (shifted) window attention -> residual; LayerNorm -> MLP -> residual."""

    def __init__(self, dim: int, heads: int, shift: int, drop_path: float) -> None:
        super().__init__()
        self.shift, self.drop_path = shift, drop_path
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, WINDOW)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h, w, _ = x.shape
        pad_h, pad_w = -h % WINDOW, -w % WINDOW
        y = F.pad(self.norm1(x), (0, 0, 0, pad_w, 0, pad_h))
        # A side that fits in one window gains nothing from shifting.
        shift = (self.shift if h + pad_h > WINDOW else 0, self.shift if w + pad_w > WINDOW else 0)
        y = self.attn(y, shift)[:, :h, :w]
        x = x + _drop_path(y, self.drop_path, self.training)
        return x + _drop_path(self.mlp(self.norm2(x)), self.drop_path, self.training)


class PatchMerging(nn.Module):
    """Halve the resolution and double the width: concatenate each 2x2 group of tokens, then project."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduce = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))
        h, w = h + h % 2, w + w % 2
        x = x.view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h // 2, w // 2, 4 * c)
        return self.reduce(self.norm(x))


class SwinTransformer(nn.Module):
    """Swin-T for images of shape (in_channels, H, W), returning (batch, num_outputs) logits."""

    def __init__(self, in_channels: int, num_outputs: int) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(in_channels, EMBED_DIM, PATCH, stride=PATCH)
        self.embed_norm = nn.LayerNorm(EMBED_DIM)
        total = sum(DEPTHS)
        layers: list[nn.Module] = []
        dim, block_index = EMBED_DIM, 0
        for stage, (depth, heads) in enumerate(zip(DEPTHS, HEADS)):
            for position in range(depth):
                drop = STOCHASTIC_DEPTH * block_index / (total - 1)
                layers.append(SwinBlock(dim, heads, shift=0 if position % 2 == 0 else WINDOW // 2, drop_path=drop))
                block_index += 1
            if stage < len(DEPTHS) - 1:
                layers.append(PatchMerging(dim))
                dim *= 2
        self.layers = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_outputs)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.patch_embed(x).permute(0, 2, 3, 1))  # (B, H/4, W/4, C)
        x = self.norm(self.layers(x))
        return self.head(x.mean(dim=(1, 2)))
