"""loggers: --logger names, the CSV table, and TensorBoard event files read back with
TensorBoard's own reader, across a resume that drops the dead attempt's later points."""
import csv
import sys
import time

import pytest

from multigpu.core import loggers
from multigpu.core.errors import UsageError
from multigpu.core.loggers import LoggingConfig
from multigpu.train.settings.flagwords import say


def scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder / loggers.TENSORBOARD_DIR))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_logger_names():
    assert loggers.parse(None) == ()
    assert loggers.parse("none") == ()
    assert loggers.parse("TensorBoard, csv,csv") == ("tensorboard", "csv")
    with pytest.raises(UsageError) as exc:  # the library's words; the CLI says --logger tb
        loggers.parse("tb")
    assert str(exc.value) == ("setup(loggers='tb'): 'tb' is not a logger; use any of tensorboard, "
                              "csv, mlflow, wandb (comma-separated), or none")


def test_a_logger_whose_package_is_missing_is_named_with_its_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails, as uninstalled
    with pytest.raises(UsageError) as exc:
        LoggingConfig(logger="csv,wandb")
    assert str(exc.value) == ("LoggingConfig(logger='wandb') needs wandb, which is not installed: "
                              "pip install 'multigpu[wandb]' (or pip install wandb); or leave wandb "
                              "out of LoggingConfig(logger=...)")
    assert say(exc.value) == ("--logger wandb needs wandb, which is not installed: pip install "
                              "'multigpu[wandb]' (or pip install wandb); or leave wandb out of --logger")


def test_csv_table_widens_its_header_and_drops_rows_after_a_step(tmp_path):
    table = loggers.CsvTable(tmp_path / "t.csv")
    table.append({"step": 1, "a": 1})
    table.append({"step": 2, "a": 2})
    table.append({"step": 3, "a": 3, "b": 9})  # a new column: the file is rewritten wider
    table = loggers.CsvTable(tmp_path / "t.csv")  # read back, as after a restart
    assert table.header == ["step", "a", "b"]
    table.drop_after(2)
    table.append({"step": 3, "a": 30})
    with open(tmp_path / "t.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "a", "b"], ["1", "1", ""], ["2", "2", ""],
                                       ["3", "30", ""]]


def test_tensorboard_and_csv_after_a_resume_hold_every_step_once(tmp_path):
    first = loggers.open_loggers("tensorboard,csv", tmp_path)
    for step in range(1, 8):  # the attempt that dies after step 7; its checkpoint was at step 4
        first.log(step, {"train/loss": step})
    first.log(4, {"val/loss": 0.5}, per_epoch=True)
    first.flush()  # no close(): the process was killed
    again = loggers.open_loggers("tensorboard,csv", tmp_path, resume_step=4)
    for step in range(5, 10):
        again.log(step, {"train/loss": 100 + step})
    again.close()
    seen = scalars(tmp_path)
    assert seen["train/loss"] == [(s, s) for s in range(1, 5)] + [(s, 100 + s) for s in range(5, 10)]
    assert seen["val/loss"] == [(4, 0.5)]
    with open(tmp_path / loggers.STEPS_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["train/loss"]) for r in rows] == (
        [(str(s), str(s)) for s in range(1, 5)] + [(str(s), str(100 + s)) for s in range(5, 10)])
    assert "val/loss" not in rows[0]  # an epoch's record goes to metrics.csv, not steps.csv


def test_wandb_runs_offline_in_the_run_folder_without_an_account(tmp_path, monkeypatch):
    import wandb  # noqa: F401  (the dev extra brings it: a failure, not a skip)
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logs = loggers.open_loggers("wandb", tmp_path, config={"lr": 0.1, "nested": {"a": 1}})
    for step in (1, 2, 3):
        logs.log(step, {"train/loss": 1.0 / step})
    logs.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")  # offline: nothing was sent
    (records,) = run.glob("run-*.wandb")  # W&B's own record log, which `wandb sync` uploads
    wanted = [text.encode() for text in ("train/loss", repr(1 / 3), "nested.a")]
    # W&B's service process may still be writing it after finish() returned (seen on a loaded
    # 2-core machine: only the file's header was there): give it a while.
    deadline = time.monotonic() + 30
    while not all(w in records.read_bytes() for w in wanted) and time.monotonic() < deadline:
        time.sleep(0.2)
    data = records.read_bytes()
    for text in wanted:
        assert text in data, text


def test_mlflow_uses_a_local_store_in_the_run_folder(tmp_path, monkeypatch):
    import mlflow  # the dev extra brings it: a failure, not a skip
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logs = loggers.open_loggers("mlflow", tmp_path, config={"lr": 0.1})
    for step in (1, 2, 3):
        logs.log(step, {"train/loss": 1.0 / step})
    run_id = logs._backends[0].run.info.run_id
    logs.close()
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(s, pytest.approx(1 / s)) for s in (1, 2, 3)]
    assert client.get_run(run_id).data.params["lr"] == "0.1"
