"""`multigpu train --model lstm|tst --data timeseries:macro` on 2 CPU processes (DDP, gloo), from an
empty folder: the embedded series needs no file, and val_mae/val_rmse reach metrics.jsonl."""
import pytest

from multigpu.train.data.datasets import load_data

from .conftest import multigpu, read_metrics

pytestmark = pytest.mark.slow

# 203 quarters; windows of 12 predicting 4: 188 windows, 3 left out between the splits, 148 + 37.
SIZES = ["--seq-length", "12", "--future-length", "4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run(model, processes) -> (run folder, finished process); each run once per module. The same
    global batch (32) and seed on 1 or 2 processes: the same data order, the same training."""
    done = {}

    def run(model: str, processes: int):
        if (model, processes) not in done:
            base = tmp_path_factory.mktemp(f"{model}{processes}")
            out = base / "run"
            proc = multigpu("train", "--model", model, "--data", "timeseries:macro", *SIZES, "--epochs", "2",
                            "--batch-size", str(32 // processes), "--seed", "1", "--devices", f"cpu:{processes}",
                            "--out", out, cwd=base)
            assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
            done[model, processes] = out, proc
        return done[model, processes]

    return run


@pytest.mark.parametrize("model", ["lstm", pytest.param("tst", marks=pytest.mark.extended)])
def test_two_process_run_reports_errors_in_original_units_that_improve(runs, model):
    out, proc = runs(model, 2)
    first, second = read_metrics(out)
    bundle = load_data("timeseries:macro", input_kind="sequence", image_size=32, seq_length=12, future_length=4)
    assert (len(bundle.train), len(bundle.val)) == (148, 37)
    # Every validation window counted once over the two ranks (37 is odd: one rank has one more).
    assert first["val_samples"] == second["val_samples"] == len(bundle.val)
    assert first["train_samples"] == second["train_samples"] == len(bundle.train)
    assert second["val_mae"] < first["val_mae"]
    assert second["val_rmse"] < first["val_rmse"]
    assert 0 < second["val_mae"] <= second["val_rmse"]  # a mean never exceeds the root mean square
    line = next(text for text in proc.stdout.splitlines() if text.startswith("epoch 2 "))
    assert f"val_mae {second['val_mae']:.4g}  val_rmse {second['val_rmse']:.4g}" in line
    assert (out / "checkpoints" / "best.pt").exists()


def test_one_and_two_processes_give_the_same_errors(runs):
    # Summed per rank and reduced once: a window counted twice, or one left out, would show here.
    one, two = read_metrics(runs("lstm", 1)[0]), read_metrics(runs("lstm", 2)[0])
    for a, b in zip(one, two):
        assert a["val_samples"] == b["val_samples"] == 37
        for key in ("val_loss", "val_mae", "val_rmse"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), key


@pytest.mark.parametrize("model, data, message", [
    ("lstm", "digits", "data 'digits' is not a time series, which sequence models (lstm, tst) need: use --data "
                       "timeseries:co2, timeseries:macro or timeseries:CSV, or another --model for this data"),
    ("cnn", "timeseries:co2", "data 'timeseries:co2' gives (seq_length, columns) windows, which image models "
                              "cannot take: use --model lstm, --model tst, --model mlp or --model linear"),
])
@pytest.mark.smoke
def test_model_and_data_that_do_not_fit_are_refused_before_any_worker_starts(tmp_path, model, data, message):
    out = tmp_path / "run"
    proc = multigpu("train", "--model", model, "--data", data, "--devices", "cpu:2", "--out", out, cwd=tmp_path)
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"multigpu: error: {message}\n", "")
    assert not out.exists()
