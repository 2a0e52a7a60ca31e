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
import os
import re
import tempfile
import threading
from contextlib import contextmanager

import numpy as np
import torch

NVIMGCODEC_HINT = "pip install 'multigpu[nvimgcodec]'"
# nvImageCodec's host threads per Decoder (parsing, and the CUDA decoder's Huffman stage): its
# default, one per core, would be 64 threads for each Decoder of 4 processes beside the loader
# workers. 8 for the one Decoder a process had; 4 of them were busy (one H200, 2026-12-03), so
# 4 for each of the pool's (NvImageCodecDecoder.threads) now.
HOST_THREADS = 4
# decode_transient's Images kept for a thread's next batch: at most this many times the bytes of
# the batch at hand (each grows to the largest image decoded into it; memory outside torch's
# allocator, which the OOM message and the batch-size search do not see)
KEPT_AT_MOST = 2


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
    (nvImageCodec's `images=`: their buffers resized, not allocated and freed per image): the
    writes are queued behind the reads of the previous batch on that stream. The largest file
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
