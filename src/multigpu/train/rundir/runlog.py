"""What `multigpu train` logs besides metrics.jsonl, on rank 0: the loggers (loggers.py) every
`--log-every` steps and every epoch, metrics.csv beside metrics.jsonl, and curves.png at the end.

    log = RunLog.open(cfg, rt, out, config, resume_step)   # a no-op on the other ranks
    log.step(step, epoch, cursor, optimizer)    # after each optimizer step: cheap unless due
    log.epoch(step, record)                     # the epoch's record, before its checkpoint
    log.metrics_written()                       # after metrics.jsonl got the epoch's line
    log.close()                                 # also when the run stops or fails

Per step (TensorBoard tags, steps.csv columns): train/loss (rank 0's mean over the steps since
the last point; reading it waits for the GPU once per point), train/lr, train/samples_per_second
(all ranks), epoch. Per epoch: the record's numbers as train/epoch_loss, val/loss, val/accuracy,
val/mae, val/rmse, perf/samples_per_second, perf/epoch_seconds, perf/input_wait (the share of the
epoch spent waiting for batches), perf/max_memory_gib.
"""
from __future__ import annotations

import time
from pathlib import Path
from collections.abc import Callable

from multigpu.train.rundir import plots, runfolder
from multigpu.core import console, loggers
from multigpu.core.system.extras import MissingExtra

# metrics.jsonl key -> TensorBoard tag
EPOCH_TAGS = {"train_loss": "train/epoch_loss", "val_loss": "val/loss", "val_accuracy": "val/accuracy",
              "val_mae": "val/mae", "val_rmse": "val/rmse", "samples_per_second": "perf/samples_per_second",
              "epoch_seconds": "perf/epoch_seconds", "max_memory_gib": "perf/max_memory_gib",
              "bad_images": "data/bad_images", "input_wait": "perf/input_wait"}


class RunLog:
    """The loggers open at the first point logged: a run that fails before its first step leaves
    no files behind (the CLI then removes its folder, see runfolder.nothing_trained)."""

    def __init__(self, out: Path | None, names: tuple[str, ...], every: int,
                 opener: Callable[[], loggers.Loggers] | None = None):
        self.out, self.names, self.every = out, names, max(1, every)
        self._opener, self._logs = opener, None
        self._window = None  # (cursor, loss sum, local samples, position, time) at the last point

    @classmethod
    def open(cls, cfg, rt, out: Path, config: dict, resume_step: int | None) -> RunLog:
        if not rt.is_main:
            return cls(None, (), 1)
        names = loggers.parse(cfg.logging.logger)
        if "csv" in names and (out / runfolder.METRICS).is_file():
            runfolder.write_metrics_csv(out)  # after a resume: the epochs kept in metrics.jsonl
        return cls(out, names, cfg.logging.log_every, lambda: loggers.open_loggers(
            names, out, resume_step=resume_step, config=config))

    @property
    def logs(self) -> loggers.Loggers | None:
        if self._logs is None and self._opener is not None:
            self._logs, self._opener = self._opener(), None
        return self._logs

    def step(self, step: int, epoch: int, cursor, optimizer) -> None:
        if step % self.every or self.logs is None:
            return
        now = time.perf_counter()
        if self._window is None or self._window[0] is not cursor:  # a new epoch (or resume)
            self._window = (cursor, 0.0, 0, cursor.begin, cursor.start)
        _, loss_then, samples_then, position_then, time_then = self._window
        loss_sum = float(cursor.loss_sum)  # waits for the GPU: once per point
        samples = cursor.local_samples - samples_then
        values = {"train/lr": optimizer.param_groups[0]["lr"], "epoch": epoch,
                  "train/samples_per_second": (cursor.position - position_then) / max(now - time_then, 1e-9)}
        if samples:
            values["train/loss"] = (loss_sum - loss_then) / samples
        self.logs.log(step, values)
        self._window = (cursor, loss_sum, cursor.local_samples, cursor.position, now)

    def epoch(self, step: int, record: dict) -> None:
        """The epoch's record to the loggers, flushed (before its checkpoint is saved)."""
        if self.logs is None:
            return
        self.logs.log(step, {tag: record[k] for k, tag in EPOCH_TAGS.items() if k in record},
                      per_epoch=True)
        self.logs.flush()

    def metrics_written(self) -> None:
        """metrics.csv again from metrics.jsonl, once the epoch's line is there."""
        if self.out is not None and "csv" in self.names:
            runfolder.write_metrics_csv(self.out)

    def close(self, *, draw: bool = True) -> None:
        if self.out is None:
            return
        if self._logs is not None:
            self._logs.close()
            self._logs = None
        if draw and (self.out / runfolder.METRICS).is_file():
            try:
                plots.draw([self.out], self.out / plots.CURVES)
            except MissingExtra as exc:
                console.info(f"no {plots.CURVES}: {exc}")
            except Exception as exc:  # the picture never hides how the run ended
                console.warn(f"no {plots.CURVES}: {type(exc).__name__}: {exc}")
