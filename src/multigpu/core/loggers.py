"""Where a run's numbers go besides metrics.jsonl: TensorBoard, CSV, and MLflow or W&B if asked.

    logs = open_loggers("tensorboard,csv", folder, resume_step=None, config=...)   # rank 0 only
    logs.log(step, {"train/loss": 0.31, "train/lr": 1e-3})   # scalars at a global step
    logs.close()

What each writes, in the run folder:
    tensorboard/events.out.tfevents.*   `tensorboard --logdir runs/` shows every run side by side
    steps.csv                           one row per log call: step and the values
    mlruns/                             MLflow's local file store (unless MLFLOW_TRACKING_URI is set)
    wandb/                              W&B offline (unless WANDB_MODE says otherwise); `wandb sync`

A run resumed in its own folder goes on from its checkpoint's step: points logged after that step
by the interrupted attempt are dropped (TensorBoard's purge_step, and the CSV rows), so every step
appears once. `parse()` needs no torch: the CLI checks --logger before starting anything.
"""
from __future__ import annotations

import csv
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from multigpu.core.system import fileio
from multigpu.core.errors import Api, Text, UsageError
from multigpu.core.system.extras import install_hint
from multigpu.core.options import Flag, check_options, option

NAMES = ("tensorboard", "csv", "mlflow", "wandb")
DEFAULT = "tensorboard,csv"
STEPS_CSV = "steps.csv"
TENSORBOARD_DIR = "tensorboard"
# logger -> the module it needs (tensorboard comes with the core install; the rest with extras)
_MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


@dataclass(frozen=True)
class LoggingConfig:
    """Where a run's numbers go and how often; its loggers are checked (names, packages
    installed) when it is made, before anything is started."""
    logger: str = option(DEFAULT, "where the numbers go besides metrics.jsonl: any of "
                                  "tensorboard, csv, mlflow, wandb (comma-separated; mlflow "
                                  "and wandb stay local), or none", flag=Flag("LIST"))
    log_every: int = option(50, "log the training loss, learning rate and speed every N steps",
                            at_least=1)

    def __post_init__(self):
        check_options(self)
        parse(self.logger, "LoggingConfig.logger")

    @property
    def names(self) -> tuple[str, ...]:
        """The loggers, as parse() reads them."""
        return parse(self.logger, "LoggingConfig.logger")


def parse(text: str | None, where: str = "setup.loggers") -> tuple[str, ...]:
    """'tensorboard,csv' -> ('tensorboard', 'csv'); 'none' or '' -> (). Raises on an unknown name
    or a logger whose package is not installed, naming the argument that took `text` (`where`,
    an Api name: setup(loggers=...), LoggingConfig.logger) in the library's words."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in (text or "").split(",") if n.strip()))
    if names in ((), ("none",)):
        return ()
    for name in names:
        if name not in NAMES:
            shown = repr(name).replace("{", "{{").replace("}", "}}")  # a template's text
            raise UsageError(Text(f"{{}}: {shown} is not a logger; use any of "
                                  f"{', '.join(NAMES)} (comma-separated), or none", Api(where, text)))
        module = _MODULES.get(name)
        if module and not _installed(module):
            raise UsageError(Text(f"{{}} needs {module}, which is not installed: "
                                  f"{install_hint(module)}; or leave {name} out of {{}}",
                                  Api(where, name), Api(where)))
    return names


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules as None: made unimportable
        return False


class Loggers:
    """The loggers of one run, written together. Only rank 0 makes one."""

    def __init__(self, backends: list):
        self._backends = backends

    def log(self, step: int, values: dict, *, per_epoch: bool = False) -> None:
        """`per_epoch`: an epoch's record, which `multigpu train` keeps in metrics.csv instead of
        the CSV of steps."""
        scalars = {k: float(v) for k, v in values.items() if v is not None}
        for b in self._backends:
            if not (per_epoch and isinstance(b, _Csv)):
                b.log(step, scalars)

    def flush(self) -> None:
        for b in self._backends:
            b.flush()

    def close(self) -> None:
        for b in self._backends:
            b.close()
        self._backends = []


def open_loggers(names: tuple[str, ...] | str, folder: Path, *, resume_step: int | None = None,
                 config: dict | None = None, csv_name: str = STEPS_CSV) -> Loggers:
    """`resume_step`: the run goes on in `folder` from this step; later points are dropped.
    `csv_name`: the CSV file in `folder` (steps.csv for `multigpu train`)."""
    if isinstance(names, str):
        names = parse(names)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    makers = {"tensorboard": _TensorBoard, "csv": _Csv, "mlflow": _MLflow, "wandb": _WandB}
    return Loggers([makers[n](folder, resume_step=resume_step, config=config or {},
                              csv_name=csv_name) for n in names])


class _TensorBoard:
    def __init__(self, folder: Path, *, resume_step: int | None, config: dict, csv_name: str):
        from torch.utils.tensorboard import SummaryWriter

        # events at a step after the checkpoint's were logged by the attempt that died
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(folder / TENSORBOARD_DIR), purge_step=purge,
                                    flush_secs=30)

    def log(self, step: int, scalars: dict) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CsvTable:
    """A CSV file of rows with a `step` column, appended to; a new column rewrites the file with
    the wider header (rare: the columns of a run are known after its first epoch)."""

    def __init__(self, path: Path):
        self.path = path
        self.header: list[str] = []
        if path.is_file():
            with open(path, newline="") as f:
                self.header = next(csv.reader(f), [])

    def drop_after(self, step: int) -> None:
        rows = [r for r in self.rows() if _step(r) is not None and _step(r) <= step]
        self._rewrite(self.header, rows)

    def rows(self) -> list[dict]:
        if not self.path.is_file():
            return []
        with open(self.path, newline="") as f:
            return list(csv.DictReader(f))

    def append(self, row: dict) -> None:
        new = [k for k in row if k not in self.header]
        if new or not self.path.is_file():
            self._rewrite(self.header + new, self.rows() + [row])
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.header).writerow(row)

    def _rewrite(self, header: list[str], rows: list[dict]) -> None:
        self.header = header
        fileio.atomic_write_csv(self.path, header, rows)


def _step(row: dict) -> int | None:
    try:
        return int(row.get("step") or "")
    except ValueError:
        return None


class _Csv:
    def __init__(self, folder: Path, *, resume_step: int | None, config: dict, csv_name: str):
        self.table = CsvTable(folder / csv_name)
        if resume_step is not None and self.table.path.is_file():
            self.table.drop_after(resume_step)

    def log(self, step: int, scalars: dict) -> None:
        self.table.append({"step": step, **{k: f"{v:.6g}" for k, v in scalars.items()}})

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class _MLflow:
    """MLflow's local file store in the run folder unless MLFLOW_TRACKING_URI says otherwise."""

    def __init__(self, folder: Path, *, resume_step: int | None, config: dict, csv_name: str):
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(f"sqlite:///{(folder / 'mlflow.db').absolute()}")
        self.run = mlflow.start_run(run_name=folder.name)
        if config:
            mlflow.log_params({k: v for k, v in _flat(config).items()})

    def log(self, step: int, scalars: dict) -> None:
        self.mlflow.log_metrics({k.replace("/", "_"): v for k, v in scalars.items()}, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.mlflow.end_run()


class _WandB:
    """Weights & Biases, offline in the run folder unless WANDB_MODE is set: never asks for an
    account; `wandb sync RUN/wandb/offline-run-*` uploads later."""

    def __init__(self, folder: Path, *, resume_step: int | None, config: dict, csv_name: str):
        import wandb

        self.run = wandb.init(dir=str(folder), name=folder.name, config=_flat(config),
                              project=os.environ.get("WANDB_PROJECT", "multigpu"),
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


def _flat(config: dict, prefix: str = "") -> dict:
    """Nested settings as one level of 'a.b' keys with text values (what trackers take)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= _flat(value, f"{name}.")
        else:
            out[name] = str(value)[:250]
    return out
