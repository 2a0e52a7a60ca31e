"""Saving a `multigpu train` run's checkpoints: a snapshot on the training thread, the file in the
background (checkpoint_writer), complete in the store (checkpoint_store); sharded state through
sharded_checkpoint. A failed save is raised on every rank, with what is intact and the way out.
"""
from __future__ import annotations

import time
from pathlib import Path

from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.core.checkpoints import sharded_checkpoint
from multigpu.train.checkpoints.checkpoint_store import CheckpointStore
from multigpu.train.checkpoints.checkpoint_writer import BackgroundWriter
from multigpu.core.errors import UsageError, os_error_text
from multigpu.train.checkpoints.runstate import RunState
from multigpu.core.runtime import Runtime
from multigpu.train.training import Job


class Checkpointer:
    """Writes a run's checkpoints: a snapshot on the training thread, the file in the background
    (checkpoint_writer), complete in the store (checkpoint_store). Every method is collective."""

    def __init__(self, rt: Runtime, job: Job, store: CheckpointStore, config: dict):
        self.rt, self.job, self.store, self.config = rt, job, store, config
        self.writer = BackgroundWriter() if rt.is_main else None
        self.last_path: Path | None = None
        self.pause = 0.0  # seconds the last save held training up (rank 0)

    def save(self, run: RunState, *, metrics: dict | None, best: bool, wait: bool = False) -> Path:
        job = self.job
        path = self.store.folder / schema.step_file_name(run.global_step)
        began = time.perf_counter()
        shards = self._save_shards(path) if self.rt.strategy.sharded_state else {}
        state = self.rt.checkpoint_state(job.model, job.optimizer, job.scheduler,
                                         weights=not shards, **shards, **run.to_checkpoint(),
                                         **{schema.METRICS: metrics, schema.CONFIG: self.config,
                                            schema.DECODE: job.decode and job.decode.state()})
        error = None
        if self.writer is not None:
            try:
                self.writer.save(state, lambda s: self.store.write(
                    s, global_step=run.global_step, run=run.summary(), best=best))
                if wait:
                    self.writer.wait()
            except Exception as exc:
                error = self._failure(exc)
            self.pause = time.perf_counter() - began
        self._raise_everywhere(error)
        self.last_path = path
        return path

    def _save_shards(self, path: Path) -> dict:
        """Every rank writes its part of the model and optimizer state beside the step file
        (sharded_checkpoint.py); {SHARDS: what the step file records} for the step file."""
        error, shards = None, None
        try:
            shards = sharded_checkpoint.save(self.rt.env, path.parent, path.stem, self.job.model,
                                             self.job.optimizer)
        except Exception as exc:  # DCP raises on every rank when one rank's write failed
            error = self._failure(exc)
        self._raise_everywhere(error)
        return {schema.SHARDS: shards}

    @property
    def failed(self) -> bool:
        return self.writer is not None and self.writer.failed

    def finish(self) -> None:
        """Wait for the last write; every rank raises if it failed."""
        error = None
        if self.writer is not None:
            try:
                self.writer.wait()
            except Exception as exc:
                error = self._failure(exc)
        self._raise_everywhere(error)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _failure(self, exc: BaseException) -> str:
        entries = self.store.entries()
        kept = (f"the last complete checkpoint, {self.store.folder / entries[-1].file}, is intact"
                if entries else "no earlier checkpoint exists")
        why = os_error_text(exc) if isinstance(exc, OSError) and exc.strerror else str(exc)
        return (f"saving a checkpoint to {self.store.folder} failed: {why}; {kept}. Free space "
                f"(df -h {self.store.folder}) or fix the folder, then run the same command with "
                f"--resume {self.store.folder.parent}")

    def _raise_everywhere(self, error: str | None) -> None:
        error = self.rt.env.broadcast_object(error)
        if error:
            raise UsageError(error)
