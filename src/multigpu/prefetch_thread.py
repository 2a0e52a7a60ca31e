"""Batches finished on the GPU by a thread, ahead of the step: for datasets with `on_device`.

Decoding a batch of JPEGs on the GPU (gpu_images) holds its caller for milliseconds: nvJPEG's
host side, then a crop and resize per image. Done in the training loop's thread, that time adds to
every step (measured on one H100, ResNet-50 batch 128: 61 % of the synthetic speed, against 97 %
with the CPU workers decoding). Here one thread per loader takes batches from the DataLoader,
copies and finishes them on its own CUDA stream, and queues them `depth` ahead; the training
thread only makes its stream wait for the batch's event. torch and torchvision release the GIL in
their kernels' host code, so the two threads overlap.
"""
from __future__ import annotations

import queue
import threading

import torch

from multigpu.data import map_tensors

_DONE = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


def finish_in_thread(batches, device: torch.device, finish, to_device, depth: int = 2):
    """Yield (info, batch) from `batches` (pairs), each moved by `to_device(batch, device, True,
    finish)` in a helper thread on a side stream, ready for the current stream to use."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    stream = torch.cuda.Stream(device)

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                for info, batch in batches:
                    moved = to_device(batch, device, True, finish)
                    done = torch.cuda.Event()
                    done.record(stream)
                    if not put((info, moved, done)):
                        return
        except BaseException as exc:  # raised again in the training thread
            put(_Failed(exc))
            return
        put(_DONE)

    thread = threading.Thread(target=work, name="multigpu-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.exc
            info, moved, done = item
            current = torch.cuda.current_stream(device)
            current.wait_event(done)
            map_tensors(lambda t: t.record_stream(current), moved)
            yield info, moved
    finally:
        stop.set()
        thread.join(timeout=10)  # a daemon: a loader stuck in its workers does not hold the exit
