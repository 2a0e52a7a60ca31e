"""Saving without stopping training for long: copy the state aside, write it in the background.

`BackgroundWriter.save(state, write)` works in two parts:
1. a snapshot, on the training thread: every tensor is copied, GPU tensors into pinned host
   buffers that are kept from one save to the next (allocating pinned memory costs more than the
   copy), CPU tensors into clones, because training goes on changing the originals. This is the
   whole pause: the copies and one wait for them.
2. `write(snapshot)` (serialising, writing, fsync, the manifest) on one thread beside training.
   The next save waits for the previous write (its buffers are reused), and a failed write is
   raised at the next save, at `wait()`, or seen by `failed`.
This is torch.distributed.checkpoint's async_save idea (staging in pinned memory, then a thread),
for the single-file checkpoints of replicated strategies.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch

from multigpu.core.loading.data import map_tensors


class Snapshot:
    def __init__(self):
        self._buffers: list[torch.Tensor] = []
        self._queued = False

    def take(self, state):
        """A copy of `state` that training can no longer change."""
        index = iter(range(1 << 62))
        self._queued = False
        copies = map_tensors(lambda t: self._copy(next(index), t.detach()), state)
        if self._queued:
            torch.cuda.synchronize()  # the device-to-host copies were queued non-blocking
        return copies

    def _copy(self, i: int, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return t.clone()
        if i >= len(self._buffers):
            self._buffers.extend([torch.empty(0)] * (i + 1 - len(self._buffers)))
        buf = self._buffers[i]
        if (buf.shape, buf.stride(), buf.dtype) != (t.shape, t.stride(), t.dtype) or not buf.is_pinned():
            buf = self._buffers[i] = staging_buffer(t, pin_memory=True)
        self._queued = True
        return buf.copy_(t, non_blocking=True)


def staging_buffer(t: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    """An empty host tensor for a copy of `t`, with `t`'s strides where they are a dense layout
    (a channels_last weight stays channels_last in the file), else contiguous."""
    dense = (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)
             or t.is_contiguous(memory_format=torch.channels_last_3d))
    if dense:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=pin_memory)
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin_memory)


class BackgroundWriter:
    """One background write at a time; its snapshot buffers are reused by the next."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="multigpu-save")
        self._snapshot = Snapshot()
        self._pending: concurrent.futures.Future | None = None

    def save(self, state, write: Callable[[object], object]) -> None:
        """Copy `state` aside now, then run `write(copy)` in the background. Waits for the
        previous write first (and raises its error)."""
        self.wait()
        copy = self._snapshot.take(state)
        self._pending = self._pool.submit(write, copy)

    def snapshot_only(self, state) -> bool:
        """Copy `state` aside into the buffers the next save reuses, and drop the copy (pause.py
        times it); False, copying nothing, while the last write still runs (it reads them)."""
        if self._pending is not None and not self._pending.done():
            return False
        self._snapshot.take(state)  # a finished write's error stays for the next save to raise
        return True

    def wait(self):
        """Block until the pending write is done; its result, or raise its error (once)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    @property
    def failed(self) -> bool:
        p = self._pending
        return p is not None and p.done() and p.exception() is not None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
