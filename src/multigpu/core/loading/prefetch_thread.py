"""Batches finished on the GPU by helper threads, ahead of the step: for datasets with `on_device`.

Decoding a batch of JPEGs on the GPU (gpu_images) holds its caller for milliseconds: nvJPEG's
host side and its wait for the decode, then the crops. Done in the training loop's thread, that
time adds to every step (measured on one H100, ResNet-50 batch 128: 61 % of the synthetic speed, against 97 %
with the CPU workers decoding). Here helper threads copy and finish each batch, each on a CUDA
stream of its own, a few batches ahead (batches_ahead); the training thread takes batches from
the DataLoader and hands them over, then only makes its stream wait for a finished batch's event.

One helper finishes one batch at a time: where a batch's finishing waits on the device (a
decoder that returns once the GPU's JPEG engines are done) and not on the host, one thread is
bound by that wait, and `threads` helpers keep that many batches in flight. Batches are yielded
in the order they were loaded, whichever helper finished them.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from multigpu.core.loading.data import map_tensors

DEPTH = 2  # batches finished ahead of the step, at least


def batches_ahead(threads: int = 1, depth: int = DEPTH) -> int:
    """Batches finish_in_thread holds finished or being finished ahead of the one it hands over:
    `depth`, and at least one more than its helpers, so that none waits for work."""
    return max(depth, max(threads, 1) + 1)


def finish_in_thread(batches, device: torch.device, prepare, depth: int = DEPTH, threads: int = 1,
                     priority: int = 0):
    """Yield (info, batch) from `batches` (pairs), each made ready by `prepare(batch)` (copied to
    `device` and finished there) in one of `threads` helper threads, each on a side stream of its
    own (of `priority`: 0, or negative for a higher one), for the current stream to use,
    batches_ahead(threads, depth) batches ahead.

    The DataLoader is iterated here, in the caller's thread: with 0 workers its samples (and their
    random crops, from torch's global generator) are made in the training thread, in order, as
    without this; only the finishing runs in the helpers."""
    threads = max(threads, 1)
    helper = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="multigpu-finish")
    own = threading.local()  # each helper's stream
    pending: deque = deque()
    source = iter(batches)

    def finish_one(batch):
        if not hasattr(own, "stream"):
            own.stream = torch.cuda.Stream(device, priority=priority)
        with torch.cuda.device(device), torch.cuda.stream(own.stream):
            moved = prepare(batch)
            done = torch.cuda.Event()
            done.record(own.stream)
            return moved, done

    def submit() -> None:
        for info, batch in source:
            pending.append((info, helper.submit(finish_one, batch)))
            return

    try:
        for _ in range(batches_ahead(threads, depth)):
            submit()
        while pending:
            info, future = pending.popleft()
            moved, done = future.result()  # the helper's exception, raised here
            submit()
            current = torch.cuda.current_stream(device)
            current.wait_event(done)
            map_tensors(lambda t, stream=current: t.record_stream(stream), moved)
            yield info, moved
    finally:
        helper.shutdown(wait=True, cancel_futures=True)
