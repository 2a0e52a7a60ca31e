"""What a run leaves to read: TensorBoard events, steps.csv, metrics.csv and curves.png from
`multigpu train`; rt.log() from a user's loop; `multigpu plot` over several runs. On cpu:2."""
import csv
import json

import pytest
from PIL import Image

from multigpu.train.rundir.runfolder import table_row
from tests.unit.test_loggers import scalars

from .conftest import REPO, multigpu, read_metrics

pytestmark = pytest.mark.slow

# 205 samples, batch 4 on 2 ranks: 26 steps an epoch, 78 in all; a point every 10 steps
ARGS = ["--model", "mlp", "--data", "synthetic:205", "--epochs", "3", "--batch-size", "4",
        "--optimizer", "sgd", "--lr", "0.05", "--workers", "0", "--devices", "cpu:2",
        "--log-every", "10"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("logs") / "run"
    proc = multigpu("train", *ARGS, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.smoke
def test_tensorboard_has_the_step_and_epoch_scalars(run):
    seen = scalars(run)
    assert [s for s, _ in seen["train/loss"]] == list(range(10, 79, 10))
    assert [s for s, _ in seen["train/lr"]] == list(range(10, 79, 10))
    assert all(v == pytest.approx(0.05) for _, v in seen["train/lr"])
    epochs = read_metrics(run)
    for tag, key in [("val/loss", "val_loss"), ("val/accuracy", "val_accuracy"),
                     ("train/epoch_loss", "train_loss"), ("perf/samples_per_second", "samples_per_second")]:
        assert seen[tag] == [(e["step"], pytest.approx(e[key], rel=1e-6)) for e in epochs], tag
    assert [e["step"] for e in epochs] == [26, 52, 78]


@pytest.mark.smoke
def test_metrics_csv_is_metrics_jsonl_as_a_table(run):
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    epochs = read_metrics(run)
    assert len(rows) == len(epochs) == 3
    for row, record in zip(rows, epochs):
        # every rank's figures of the epoch (2 ranks: data and compute ms each) as columns
        assert {f"rank{r}_{k}" for r in (0, 1) for k in ("data_ms", "compute_ms")} <= row.keys()
        assert row.keys() == table_row(record).keys()
        assert {k: float(v) for k, v in row.items()} == pytest.approx(
            {k: float(v) for k, v in table_row(record).items()})


@pytest.mark.smoke
def test_steps_csv_and_curves_png(run):
    with open(run / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(10, 79, 10))
    assert [int(r["epoch"]) for r in rows] == [1, 1, 2, 2, 2, 3, 3]
    assert all(float(r["train/loss"]) > 0 and float(r["train/samples_per_second"]) > 0 for r in rows)
    with Image.open(run / "curves.png") as png:
        assert png.format == "PNG" and png.size[0] > 800 and png.size[1] > 300


def test_logger_none_writes_no_logs_but_still_the_picture(tmp_path):
    out = tmp_path / "quiet"
    proc = multigpu("train", *ARGS, "--epochs", "1", "--logger", "none", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / "tensorboard").exists() and not (out / "steps.csv").exists()
    assert not (out / "metrics.csv").exists() and (out / "curves.png").is_file()


def test_rt_log_writes_rank_0s_values_once(tmp_path):
    proc = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path / "logs",
                    REPO / "tests" / "multiproc" / "lib_scripts" / "log_values.py", tmp_path / "lib")
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = scalars(tmp_path / "lib")
    assert seen["train/loss"] == [(s, 10.0 * s) for s in range(1, 6)]
    assert seen["rank"] == [(s, 0.0) for s in range(1, 6)]
    assert seen["val/accuracy"] == [(5, 0.5)]
    with open(tmp_path / "lib" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["train/loss"], r["rank"]) for r in rows[:5]] == [
        (str(s), str(10 * s), "0") for s in range(1, 6)]
    assert (rows[5]["step"], rows[5]["val/accuracy"]) == ("5", "0.5")


@pytest.mark.smoke
def test_plot_draws_several_runs_and_never_replaces_a_file(run, tmp_path):
    second = tmp_path / "second"
    second.mkdir()
    (second / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    picture = tmp_path / "both.png"
    proc = multigpu("plot", run, second, "--out", picture)
    assert proc.returncode == 0, proc.stderr
    with Image.open(picture) as png:
        assert png.format == "PNG"
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"the user's own picture")
    proc = multigpu("plot", run, "--out", mine)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"multigpu: error: --out {mine} already exists; multigpu does not "
                                   "replace your files: choose another name")
    assert mine.read_bytes() == b"the user's own picture"
    proc = multigpu("plot", run, tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"multigpu: error: {tmp_path} holds no metrics.jsonl (no finished "
                                   "epoch yet?): give run folders made by multigpu train, e.g. runs/<name>")


@pytest.mark.extended  # make test stays under 15 minutes; CI runs it
def test_a_profile_of_steps_30_to_34_is_said_and_written_by_every_rank(tmp_path):
    """MULTIGPU_PROFILE_STEPS: the window (in the second epoch here) profiled on both ranks, each
    rank's numbers in profile/, rank 0's trace beside them, one line on the console; a window
    the run does not reach is said at its end."""
    import subprocess
    import sys

    from .conftest import cli_env

    def train(window, out):
        return subprocess.run([sys.executable, "-m", "multigpu", "train", *ARGS[:5], "2", *ARGS[6:],
                               "--logger", "none", "--out", str(out)], capture_output=True, text=True,
                              timeout=240, env={**cli_env(), "MULTIGPU_PROFILE_STEPS": window})

    proc = train("30-34", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("profile of")]
    assert len(said) == 1 and said[0].startswith("profile of steps 30-34, rank 0: ")
    assert f"trace: {tmp_path / 'run' / 'profile' / 'trace-rank0.json'}" in said[0]
    ranks = [json.loads((tmp_path / "run" / "profile" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(n["rank"], n["first"], n["last"], n["epoch_ends"]) for n in ranks] == [(0, 30, 34, 0), (1, 30, 34, 0)]
    assert all(n["step_ms"] > 0 for n in ranks)
    assert sorted(p.name for p in (tmp_path / "run" / "profile").iterdir()) == [
        "rank0.json", "rank1.json", "trace-rank0.json"]
    assert json.loads((tmp_path / "run" / "profile" / "trace-rank0.json").read_text())["traceEvents"]

    proc = train("25-28", tmp_path / "over")  # the end of epoch 1 (step 26) inside the window
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("profile of")]
    assert len(said) == 1 and said[0].endswith("; the window holds the end of an epoch (its evaluation "
                                               "and checkpoint): profile steps within one epoch for a "
                                               "step's own time"), said
    assert json.loads((tmp_path / "over" / "profile" / "rank1.json").read_text())["epoch_ends"] == 1

    proc = train("50-60", tmp_path / "short")  # 2 epochs of 26 steps
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("MULTIGPU_PROFILE_STEPS: steps 50-60 were not all trained in this run: no profile"
            in proc.stdout + proc.stderr)
    assert not (tmp_path / "short" / "profile").exists()


def test_a_profile_from_the_first_step_with_accumulate_profiles_the_optimizer_steps_that_hold_it(tmp_path):
    """Steps 1-3 under --accumulate 2: no step 0 comes to start the profiler after, and the
    optimizer steps end at steps 2 and 4, never at 3; the profile is of steps 1-4."""
    import subprocess
    import sys

    from .conftest import cli_env

    proc = subprocess.run([sys.executable, "-m", "multigpu", "train", *ARGS[:5], "1", *ARGS[6:],
                           "--accumulate", "2", "--logger", "none", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=240,
                          env={**cli_env(), "MULTIGPU_PROFILE_STEPS": "1-3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("profile of")]
    assert len(said) == 1 and said[0].startswith("profile of steps 1-4, rank 0: "), said
    ranks = [json.loads((tmp_path / "run" / "profile" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(n["rank"], n["first"], n["last"], n["epoch_ends"]) for n in ranks] == [(0, 1, 4, 0), (1, 1, 4, 0)]
