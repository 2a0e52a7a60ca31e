"""How long a checkpoint holds training up, measured the way Checkpointer.save pauses: the
model's, optimizer's and scheduler's state gathered and copied aside (checkpoint_writer's
snapshot), without the write that follows in the background. Both estimates time it here:
`multigpu doctor`'s (timing.py) and `multigpu train`'s after its first timed steps
(run_estimate.py), before any checkpoint of the run exists.

It runs on one rank alone (train's estimate is rank 0's), so nothing collective is in it: the
gather of the ranks' RNG streams (a few bytes each) is left out, and a strategy whose state is
sharded (FSDP: every rank writes its part, a collective) is not timed (None). On a GPU the copy is
timed twice and the second said: the first allocates the pinned host buffers that every later
save reuses (when given the run's own writer, the run's first save then reuses them too).
"""
from __future__ import annotations

import time

from multigpu.train.checkpoints.checkpoint_writer import BackgroundWriter


def checkpoint_pause(rt, job, writer: BackgroundWriter | None = None) -> float | None:
    """Seconds one checkpoint holds training up on this rank; None where it cannot be timed
    alone (sharded state) or the writer's last write is still running (its buffers are in use)."""
    if rt.strategy.sharded_state:
        return None
    own = writer is None
    writer = writer or BackgroundWriter()
    try:
        seconds = None
        for _ in range(2 if rt.device.type == "cuda" else 1):
            began = time.perf_counter()
            if not writer.snapshot_only(_state(rt, job)):
                return None
            seconds = time.perf_counter() - began
        return seconds
    finally:
        if own:
            writer.close()


def _state(rt, job) -> dict:
    """What Checkpointer.save copies aside, less the ranks' RNG streams (a collective)."""
    return {"model": rt.strategy.model_state_dict(job.model),
            "optimizer": rt.strategy.optimizer_state_dict(job.model, job.optimizer),
            "scheduler": job.scheduler.state_dict() if job.scheduler is not None else None}
