"""nvImageCodec's decoder (NvImageCodecDecoder): a batch of JPEGs in one call, on the GPU's hardware
JPEG engines where it has them; its import kept quiet. jpeg_decoders chooses it where it works."""
from __future__ import annotations

import os
import re
import tempfile
import threading
from contextlib import contextmanager

import numpy as np
import torch

from multigpu.train.data.jpeg_decoder_base import JpegDecoder

# nvImageCodec's host threads per Decoder (parsing, and the CUDA decoder's Huffman stage): its
# default, one per core, would be 64 threads for each Decoder of 4 processes beside the loader
# workers. 8 for the one Decoder a process had; 4 of them were busy (one H200, 2026-12-03), so
# 4 for each of the pool's (NvImageCodecDecoder.threads) now.
HOST_THREADS = 4
# decode_transient's Images kept for a thread's next batch: at most this many times the bytes of
# the batch at hand (each grows to the largest image decoded into it; memory outside torch's
# allocator, which the OOM message and the batch-size search do not see)
KEPT_AT_MOST = 2


class NvImageCodecDecoder(JpegDecoder):
    """NVIDIA nvImageCodec: a batch in one call, decoded on the hardware JPEG engines where
    `hardware` (a file they refuse on its CUDA decoder), on the CUDA cores otherwise, on the
    host (libjpeg-turbo) for a CPU device.

    Its outputs are allocated stream-ordered on the caller's stream (the finishing thread's) and
    freed on it when the tensors viewing them (DLPack, no copy) are released: after the crops
    queued on that stream have read them. A call holds its thread until the engines are done
    (the GIL released meanwhile), so `threads` batches are decoded at once, each by an
    nvImageCodec Decoder of its own: a pool of `threads` made here, at start-up (where the
    library's noise on fd 2 is held back); a call that finds none free waits for one (the train
    and validation loaders' threads may call at once).

    decode_transient decodes into the Images of the thread's previous call on the same stream
    (nvImageCodec's `images=`: their buffers resized, not allocated and freed per image). The
    engines do not wait for the work queued on the stream before they write (one H100,
    nvImageCodec 0.9.0.20, 2026-12-07: a batch read behind a busy stream came out with the next
    batch's pixels, tests/gpu/test_decode_gpu.py), so the thread first waits until its stream has
    run what was queued on it, the previous batch's reads among it. The largest file
    goes into the largest Image, and what a thread keeps stays under KEPT_AT_MOST times the
    bytes of the batch at hand. It spares the allocations and frees of every image, which slow
    the decode beside a busy GPU (measured: benchmarks/results/2026-12-04-1xH200-round7/)."""
    threads = 2

    def __init__(self, device: torch.device, hardware: bool = True, fallback: bool = True,
                 pool: int | None = None):
        nvimgcodec = import_nvimgcodec()
        kinds = nvimgcodec.BackendKind
        if device.type == "cuda":
            backends = ([kinds.HW_GPU_ONLY] + [kinds.GPU_ONLY] * fallback) if hardware else [kinds.GPU_ONLY]
            device_id = device.index if device.index is not None else torch.cuda.current_device()
        else:
            backends, device_id = [kinds.CPU_ONLY], nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY
        self.name = ("nvImageCodec, hardware JPEG engines" if device.type == "cuda" and hardware
                     else "nvImageCodec, CUDA" if device.type == "cuda" else "nvImageCodec, CPU")
        self._nv = nvimgcodec
        with quiet_stderr():  # a backend that fails raises here
            self._free = [nvimgcodec.Decoder(device_id=device_id, max_num_cpu_threads=HOST_THREADS,
                                             backends=[nvimgcodec.Backend(k) for k in backends])
                          for _ in range(max(pool or self.threads, 1))]
        self.pool_size = len(self._free)
        self._returned = threading.Condition()
        self._previous = threading.local()  # .images: (the stream, the Images of its last call)
        self._reuses = True  # off where this nvImageCodec has no images=
        # EXIF orientation off: the crop boxes were drawn on the stored (unrotated) size, as PIL
        # and torchvision read it. Planar RGB: (3, H, W) as it comes.
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                               sample_format=nvimgcodec.SampleFormat.P_RGB)

    @contextmanager
    def _decoder(self):
        """A Decoder of the pool, this thread's alone until the block ends."""
        with self._returned:
            self._returned.wait_for(lambda: self._free)
            decoder = self._free.pop()
        try:
            yield decoder
        finally:
            with self._returned:
                self._free.append(decoder)
                self._returned.notify()

    def decode(self, encoded, device):
        return self._decode(encoded, device, transient=False)

    def decode_transient(self, encoded, device):
        return self._decode(encoded, device, transient=True)

    def _decode(self, encoded, device, transient: bool):
        sources = [self._code_stream(data) for data in encoded]
        readable = [k for k, s in enumerate(sources) if s is not None]
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        chosen = [sources[k] for k in readable]
        decoded, into = [], self._earlier_images(stream, chosen) if transient and chosen else None
        if into is not None and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the previous batch read: see above
        if chosen:
            with self._decoder() as decoder:
                decoded = self._call(decoder, chosen, stream, into)
        if transient and into is None:
            self._keep(stream, decoded)
        images: list[torch.Tensor | None] = [None] * len(encoded)
        for k, image in zip(readable, decoded, strict=True):
            if image is None:
                continue
            if device.type != "cuda":
                images[k] = torch.from_numpy(np.array(image))
            else:  # an Image decoded into again gives no second DLPack capsule: its array interface
                images[k] = torch.as_tensor(image, device=device) if transient else torch.from_dlpack(image)
        return images

    def _call(self, decoder, sources: list, stream: int, into: list | None) -> list:
        if into is not None:
            try:
                return decoder.decode(sources, params=self._params, cuda_stream=stream, images=into)
            except TypeError:  # an nvImageCodec without images=: new Images from now on
                self._reuses = False
        return decoder.decode(sources, params=self._params, cuda_stream=stream)

    def _earlier_images(self, stream: int, sources: list) -> list | None:
        """Images this thread's earlier calls on `stream` decoded into, one for each of `sources`,
        where it has enough: the largest file into the Image of the largest capacity, and so on,
        so that each grows no larger than the files of its rank in a batch need. Past KEPT_AT_MOST
        times the batch's bytes, they are let go (the call then makes new Images, kept instead)."""
        earlier = getattr(self._previous, "images", None)
        if not self._reuses or earlier is None or earlier[0] != stream or len(earlier[1]) < len(sources):
            return None
        kept, needs = earlier[1], [_bytes_needed(source) for source in sources]
        capacities = [getattr(image, "capacity", None) for image in kept]
        if None in capacities:  # an nvImageCodec that does not say: no reuse it cannot bound
            self._reuses, self._previous.images = False, None
            return None
        if sum(capacities) > KEPT_AT_MOST * sum(needs):
            self._previous.images = None
            return None
        largest = sorted(range(len(kept)), key=capacities.__getitem__, reverse=True)
        into = [None] * len(sources)
        for rank, k in enumerate(sorted(range(len(sources)), key=needs.__getitem__, reverse=True)):
            into[k] = kept[largest[rank]]
        return into

    def _keep(self, stream: int, decoded: list) -> None:
        """A new call's Images, for the thread's next ones on `stream` to decode into (each of them
        decoded: the Images of a failed file may hold nothing to reuse)."""
        if decoded and all(image is not None for image in decoded):
            self._previous.images = (stream, list(decoded))

    def _code_stream(self, data: torch.Tensor):
        """The file parsed (its header), or None where it is not an image nvImageCodec knows."""
        try:
            return self._nv.CodeStream(data.numpy())
        except RuntimeError:  # "Failed to get image info"
            return None


def _bytes_needed(source) -> int:
    """Bytes of a code stream's image decoded as planar RGB; 0 where its header says nothing (a
    file the decode will then give None for)."""
    try:
        return 3 * source.height * source.width
    except RuntimeError:  # "Failed to get image info": parsed when first asked
        return 0


def import_nvimgcodec():
    """nvidia.nvimgcodec, its log quiet: it names every codec library it misses (nvJPEG2000,
    nvTIFF) on each rank's terminal, though JPEGs need neither. The user's setting wins."""
    previous = os.environ.get("PYNVIMGCODEC_VERBOSITY")
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    try:
        with quiet_stderr():
            from nvidia import nvimgcodec
    finally:
        if previous is None:
            os.environ.pop("PYNVIMGCODEC_VERBOSITY", None)
    return nvimgcodec


_MISSING_CODEC = re.compile(r"nvjpeg2k|nvjpeg2000|nvtiff|libcuda\.so", re.IGNORECASE)


_stderr_swap = threading.RLock()  # one swap of fd 2 at a time: swaps that overlapped would restore out of order


@contextmanager
def quiet_stderr():
    """Holds back what C code writes to file descriptor 2 meanwhile, and writes it back without
    the lines on codec libraries JPEGs do not need. Hazard: process-wide; only for the moments
    the decoder starts (at start-up: its import, and the Decoders of its pool)."""
    with _stderr_swap, tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True)
                    if not _MISSING_CODEC.search(line) and not line.startswith("Note: If using nvImageCodec")]
            if kept:
                os.write(2, "".join(kept).encode())


