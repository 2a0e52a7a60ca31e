"""The JPEG decoders of the GPU path (gpu_images), behind one small interface, and the choice of one.

`decode(encoded, device)` takes the files' bytes (uint8 tensors on the host) and gives uint8
(3, H, W) images on `device`, RGB (grey and CMYK converted), None where a file could not be
decoded there (gpu_images then tries PIL, and names the file if that fails too). A failure of
the call as a whole that is the device's (out of memory, a CUDA error) is raised.

On a GPU, the first of these that passes its probe (a small JPEG made here, decoded, its pixels
checked) decodes for the whole process:
- nvImageCodec on the hardware JPEG engines (A100, H100, H200): batched, and it leaves the GPU's
  cores to training, where nvJPEG's CUDA decoder competes with it for them. A file the engines
  refuse goes to nvImageCodec's CUDA decoder. `pip install 'multigpu[nvimgcodec]'`.
- torchvision's `decode_jpeg(device="cuda")`, as before nvImageCodec: one batched nvJPEG call.
- nvImageCodec's CUDA decoder, where torchvision is missing and the GPU has no engines.
Off CUDA (the CPU tests) PIL decodes; nvImageCodec's CPU backend (libjpeg-turbo) also runs there.

What goes where stays as gpu_images.gpu_readable says for every decoder: CMYK and progressive
JPEGs, which nvImageCodec decodes but not on the engines, are left to the loader workers.
"""
from __future__ import annotations

import io
import threading
from contextlib import contextmanager

import torch

from multigpu.train.data.jpeg_decoder_base import JpegDecoder, pil_decode, raise_if_device_failed
from multigpu.train.data.nvimgcodec_decoder import (HOST_THREADS, KEPT_AT_MOST,  # noqa: F401 (theirs)
                                                    NvImageCodecDecoder, import_nvimgcodec)

NVIMGCODEC_HINT = "pip install 'multigpu[nvimgcodec]'"


class PilDecoder(JpegDecoder):
    """PIL on the host: the device path off CUDA, so that it runs everywhere."""
    name = "PIL"

    def decode(self, encoded, device):
        images = []
        for data in encoded:
            try:
                images.append(pil_decode(data).to(device))
            except Exception:
                images.append(None)
        return images


class TorchvisionDecoder(JpegDecoder):
    """torchvision.io.decode_jpeg on a list, device="cuda": one nvJPEG call per batch."""
    name = "torchvision's nvJPEG"

    def decode(self, encoded, device):
        from torchvision.io import ImageReadMode, decode_jpeg

        def call(files):
            # torchvision allocates its outputs on the caller's stream but writes them from its
            # own (pytorch/vision#9606): a block freed on this stream with kernels still queued
            # that read it could be overwritten. Nothing queued, nothing to overwrite.
            torch.cuda.current_stream(device).synchronize()
            return decode_jpeg(files, mode=ImageReadMode.RGB, device=device)

        try:
            return list(call(encoded))
        except Exception as exc:  # one bad file fails the whole call (RuntimeError): find it
            raise_if_device_failed(exc)
        images = []
        for data in encoded:
            try:
                images.append(call([data])[0])
            except Exception as exc:
                raise_if_device_failed(exc)
                images.append(None)
        return images


_chosen: dict[str, JpegDecoder | str] = {}
_choice_lock = threading.Lock()


def choose(device: torch.device) -> JpegDecoder | str:
    """The decoder of `device`'s JPEGs, or why none works there (one line). Probed once per
    process and device; PIL off CUDA."""
    key = str(device)
    with _choice_lock:
        if key not in _chosen:
            _chosen[key] = PilDecoder() if device.type != "cuda" else _first_working(device)
        return _chosen[key]


def use(device: torch.device, decoder: JpegDecoder) -> None:
    """Decode `device`'s JPEGs with `decoder` from now on, probed or not (tests, benchmarks)."""
    with _choice_lock:
        _chosen[str(device)] = decoder


def _first_working(device: torch.device) -> JpegDecoder | str:
    problems = []
    for make in (_nvimgcodec_engines, _torchvision, _nvimgcodec_cuda):
        made = make(device)
        if isinstance(made, JpegDecoder):
            problem = probe_problem(made, device)
            if problem is None:
                return made
            made = problem
        problems.append(made)
    return "; ".join(dict.fromkeys(problems))  # the CUDA variant repeats a missing nvImageCodec


def _nvimgcodec_engines(device: torch.device) -> JpegDecoder | str:
    """nvImageCodec with the hardware engines first, where a decoder of the engines alone
    decodes the probe's JPEG (elsewhere its CUDA decoder would pass for them)."""
    problem = _nvimgcodec_missing()
    if problem:
        return problem
    try:
        engines_only = NvImageCodecDecoder(device, hardware=True, fallback=False, pool=1)
    except Exception as exc:
        return f"nvImageCodec does not start on {device} ({_first_line(exc)})"
    if probe_problem(engines_only, device) is not None:
        return f"nvImageCodec finds no hardware JPEG engines on {device}"
    del engines_only
    try:  # the engines, and nvImageCodec's CUDA decoder for the files they refuse
        return NvImageCodecDecoder(device, hardware=True)
    except Exception:  # its CUDA decoder did not start on an H100 (nvImageCodec 0.9, CUDA 13):
        return NvImageCodecDecoder(device, hardware=True, fallback=False)  # gpu_images tries PIL


def _nvimgcodec_cuda(device: torch.device) -> JpegDecoder | str:
    problem = _nvimgcodec_missing()
    if problem:
        return problem
    try:
        return NvImageCodecDecoder(device, hardware=False)
    except Exception as exc:
        return f"nvImageCodec does not start on {device} ({_first_line(exc)})"


def _torchvision(device: torch.device) -> JpegDecoder | str:
    try:
        import torchvision.io  # noqa: F401
    except Exception as exc:
        return f"torchvision does not import ({_first_line(exc)})"
    return TorchvisionDecoder()


def _nvimgcodec_missing() -> str | None:
    try:
        import_nvimgcodec()
    except ModuleNotFoundError:
        return f"nvImageCodec is not installed ({NVIMGCODEC_HINT})"
    except Exception as exc:
        return f"nvImageCodec does not import ({_first_line(exc)})"
    return None


def probe_problem(decoder: JpegDecoder, device: torch.device) -> str | None:
    """Why `decoder` cannot be trusted on `device` (one line), or None: it decodes a small JPEG
    made here to the colour it was made of."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (24, 16), (200, 30, 90)).save(buffer, format="JPEG", quality=95)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    try:
        with torch.cuda.device(device) if device.type == "cuda" else _nothing():
            image = decoder.decode([data], device)[0]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception as exc:
        return f"{decoder.name} failed to decode a JPEG here ({_first_line(exc)})"
    if image is None:
        return f"{decoder.name} could not decode a JPEG here"
    if tuple(image.shape) != (3, 16, 24) or abs(int(image[0].float().mean()) - 200) > 8:
        return f"{decoder.name} gave wrong pixels on this device"
    return None


@contextmanager
def _nothing():
    yield


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


