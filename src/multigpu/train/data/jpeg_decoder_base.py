"""What every JPEG decoder of the GPU path is (JpegDecoder) and the helpers they share: PIL's
decode of one file, and the line between a file's failure and the device's. jpeg_decoders chooses
among them."""
from __future__ import annotations

import io

import numpy as np
import torch


class JpegDecoder:
    """A decoder of JPEG files into uint8 (3, H, W) RGB images on one device."""
    name = "?"  # as the start-up line names it
    # Batches one process may have this decoder decode at once, from as many threads
    # (prefetch_thread's helpers): more than one where a call waits on the device, not the host.
    threads = 1

    def decode(self, encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
        raise NotImplementedError

    def decode_transient(self, encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
        """As decode, for a caller that reads the images only on its current stream and lets go of
        them before its next call from this thread (gpu_images' crops): a decoder may then write
        the next batch into the memory of this one (NvImageCodecDecoder does)."""
        return self.decode(encoded, device)


def pil_decode(encoded: torch.Tensor) -> torch.Tensor:
    from PIL import Image

    with Image.open(io.BytesIO(encoded.numpy().tobytes())) as image:
        array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


def raise_if_device_failed(exc: BaseException) -> None:
    """Out of memory, or a CUDA error: the device's fault, not the file's."""
    if isinstance(exc, torch.OutOfMemoryError) or type(exc).__name__ == "AcceleratorError" \
            or "CUDA error" in str(exc):
        raise exc
