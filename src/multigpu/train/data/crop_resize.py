"""Crop, resize and flip a batch of differently sized images in a few batched kernels.

A bilinear, antialiased resize is separable: out = Wy @ image @ Wx^T, with one weight row per
output pixel. The weights here are PIL's (a triangle as wide as the scale when shrinking, clipped
to the image, not to the box, as PIL's `resize(box=...)` clips), so the GPU path's pixels are the
PIL path's to a level or so. The crop is in the weights (zero outside the window), and so is the
flip (rows reversed). Per image only its window is sliced and copied into a padded batch; the
rest is a handful of batched operations, whatever the batch size (a crop and an interpolate per
image before: about six calls an image, and up to 5 levels from PIL's pixels).

Memory: images are padded to the largest window of their chunk; chunks are cut so that a padded
chunk stays under CHUNK_BYTES (very large photos among small ones do not pad the whole batch).

The weights are built from each output pixel's few taps and scattered into a zeroed matrix
(_band_weights): the dense form (_weights, every output pixel against every window pixel in
float64) is the reference they are tested against. VARIANTS holds both ways, for
benchmarks/crop_resize_cost.py to weigh what each costs a training step beside it.
"""
from __future__ import annotations

import math

import torch

CHUNK_BYTES = 512 * 2**20


def crop_resize(images: list[torch.Tensor], boxes: list[tuple[int, int, int, int]],
                flips: list[bool], size: int) -> torch.Tensor:
    """float (N, 3, size, size), unrounded: image k's box (left, top, width, height) resized to
    size x size, mirrored left-right where flips[k]. Images are uint8 (3, H, W) on one device."""
    return crop_resize_padded_band(images, boxes, flips, size)


def crop_resize_padded(images, boxes, flips, size: int) -> torch.Tensor:
    """Chunks of images padded to their largest window, dense float64 weights."""
    chunks = _chunks([im.shape[1] * im.shape[2] for im in images])
    return _by_chunks(images, boxes, flips, size, chunks, band=False)


def crop_resize_padded_band(images, boxes, flips, size: int) -> torch.Tensor:
    """As crop_resize_padded, the weights from each output pixel's taps alone (_band_weights)."""
    chunks = _chunks([im.shape[1] * im.shape[2] for im in images])
    return _by_chunks(images, boxes, flips, size, chunks, band=True)


def _dtype(device: torch.device) -> torch.dtype:
    """Half on the GPU (tensor cores; uint8 pixels are exact in it), float elsewhere."""
    return torch.float16 if device.type == "cuda" else torch.float32


def _by_chunks(images, boxes, flips, size: int, chunks: list[list[int]], band: bool) -> torch.Tensor:
    device = images[0].device
    out = torch.empty((len(images), 3, size, size), dtype=torch.float32, device=device)
    for chunk in chunks:
        out[chunk] = _resize_chunk([images[k] for k in chunk], [boxes[k] for k in chunk],
                                   [flips[k] for k in chunk], size, band)
    return out


def _chunks(areas: list[int]) -> list[list[int]]:
    """Indices, largest first, cut so that count x largest area x 3 x 2 bytes <= CHUNK_BYTES."""
    order = sorted(range(len(areas)), key=lambda k: -areas[k])
    chunks, current = [], []
    for k in order:
        if current and (len(current) + 1) * areas[current[0]] * 6 > CHUNK_BYTES:
            chunks.append(current)
            current = []
        current.append(k)
    return chunks + ([current] if current else [])


def _resize_chunk(images, boxes, flips, size: int, band: bool) -> torch.Tensor:
    device, dtype = images[0].device, _dtype(images[0].device)
    windows = [_window(im.shape[1:], box, size) for im, box in zip(images, boxes, strict=True)]
    rows = max(w[1] - w[0] for w in windows)
    cols = max(w[3] - w[2] for w in windows)
    padded = torch.zeros((len(images), 3, rows, cols), dtype=dtype, device=device)
    for k, (image, (r0, r1, c0, c1)) in enumerate(zip(images, windows, strict=True)):
        padded[k, :, :r1 - r0, :c1 - c0] = image[:, r0:r1, c0:c1]  # the one op an image costs
    wy, wx = _axis_weights(boxes, windows, flips, size, padded, band)
    return (wy[:, None] @ padded @ wx.transpose(1, 2)[:, None]).float()


def _axis_weights(boxes, windows, flips, size: int, padded: torch.Tensor, band: bool):
    """(wy (N, size, rows), wx (N, size, cols)) in the dtype and on the device of `padded`
    (N, 3, rows, cols), wx's rows reversed where flipped."""
    rows, cols, dtype, device = *padded.shape[-2:], padded.dtype, padded.device
    info = torch.tensor([(left, top, w, h, r0, r1, c0, c1, flip) for (left, top, w, h), (r0, r1, c0, c1), flip
                         in zip(boxes, windows, flips, strict=True)], dtype=torch.float64).to(device)
    left, top, width, height, r0, r1, c0, c1, flip = info.unbind(1)
    if band:
        return (_band_weights(top - r0, height, r1 - r0, (size, rows, _taps([b[3] for b in boxes], size)),
                              None, dtype),
                _band_weights(left - c0, width, c1 - c0, (size, cols, _taps([b[2] for b in boxes], size)),
                              flip, dtype))
    wy = _weights(top - r0, height, r1 - r0, size, rows)
    wx = _weights(left - c0, width, c1 - c0, size, cols)
    wx = torch.where(flip.bool().view(-1, 1, 1), wx.flip(1), wx)
    return wy.to(dtype), wx.to(dtype)


def _window(shape, box, size: int) -> tuple[int, int, int, int]:
    """Rows r0:r1 and columns c0:c1 of the image that the box's weights reach."""
    height, width = shape
    left, top, w, h = box
    reach_y, reach_x = max(h / size, 1.0) + 1, max(w / size, 1.0) + 1
    return (max(0, math.floor(top - reach_y)), min(height, math.ceil(top + h + reach_y)),
            max(0, math.floor(left - reach_x)), min(width, math.ceil(left + w + reach_x)))


def _weights(start, length, extent, size: int, span: int) -> torch.Tensor:
    """(N, size, span): PIL's bilinear weights of each output pixel over a window's pixels.
    start/length: the box along this axis in window coordinates; extent: the window's length
    (pixels past it are padding, and past the image's edge for PIL)."""
    scale = (length / size)[:, None, None]
    support = scale.clamp(min=1.0)
    out = torch.arange(size, device=start.device, dtype=start.dtype)[None, :, None]
    centers = start[:, None, None] + (out + 0.5) * scale
    pixels = torch.arange(span, device=start.device, dtype=start.dtype)[None, None, :]
    w = (1 - ((pixels + 0.5) - centers).abs() / support).clamp(min=0)
    w = w * (pixels < extent[:, None, None])
    return (w / w.sum(-1, keepdim=True).clamp(min=1e-12)).float()


def _taps(lengths: list[int], size: int) -> int:
    """Pixels that one output pixel's triangle can touch, at most, over the batch (from the host:
    no sync)."""
    return math.ceil(2 * max(max(lengths) / size, 1.0)) + 2


def _band_weights(start, length, extent, grid: tuple[int, int, int], flip, dtype) -> torch.Tensor:
    """_weights' values (reversed along the output where `flip`), `grid` (size, span, taps):
    computed for the `taps` pixels from the first one each output pixel can reach and scattered into zeros: the dense
    form was ~10 float64 passes over N x size x span, this is one fill of it in `dtype`.
    Taps outside the window go to a spare column that is cut off."""
    size, span, taps = grid
    scale = (length / size)[:, None, None]
    support = scale.clamp(min=1.0)
    out = torch.arange(size, device=start.device, dtype=start.dtype)[None, :, None]
    if flip is not None:
        out = torch.where(flip.bool()[:, None, None], size - 1 - out, out)
    centers = start[:, None, None] + (out + 0.5) * scale
    first = torch.floor(centers - support - 0.5)
    pixels = first + torch.arange(taps, device=start.device, dtype=start.dtype)[None, None, :]
    inside = (pixels >= 0) & (pixels < extent[:, None, None])
    w = (1 - ((pixels + 0.5) - centers).abs() / support).clamp(min=0) * inside
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-12)
    index = torch.where(inside, pixels, span).long()
    dense = torch.zeros((len(start), size, span + 1), dtype=dtype, device=start.device)
    return dense.scatter_(2, index, w.to(dtype))[..., :span]


VARIANTS = {"padded": crop_resize_padded, "padded_band": crop_resize_padded_band}
