"""Time series: the lstm and tst models, the embedded series, the split by time, val_mae/val_rmse."""
from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import math

import numpy as np
import pytest
import torch

import multigpu
from multigpu.train.data.datasets import load_data
from multigpu.train.engine import StepSettings, evaluate
from multigpu.core.errors import UsageError
from multigpu.train.models.catalog import build_model, model_input_kind
from multigpu.train.models.seqmodels import SEQUENCE_MODELS

# Shape, header and the sha256 of the decompressed CSV text: the data every `timeseries:co2|macro`
# run trains on (series/SOURCE.md says where it comes from).
EMBEDDED = {
    "co2": ((2284, 1), "co2", "9d29483c43a1b79804af3d7c89cdbe410b3b8564e550f4990a2e7c6294170714"),
    "macro": ((203, 12), "realgdp,realcons,realinv,realgovt,realdpi,cpi,m1,tbilrate,unemp,pop,infl,realint",
              "29ff6196a4eb5b4f27752b56bb7a1319bd7a5622f843a47b91adde941acc9527"),
}


def load(spec, **kwargs):
    return load_data(spec, input_kind="sequence", image_size=32, **kwargs)


# --- models -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SEQUENCE_MODELS)
@pytest.mark.parametrize("seq, future, columns", [(1, 1, 1), (12, 1, 3), (40, 4, 12), (80, 8, 2)])
def test_output_is_future_rows_of_every_column_and_every_parameter_gets_a_gradient(name, seq, future, columns):
    torch.manual_seed(0)
    model = build_model(name, (seq, columns), future * columns).train()
    out = model(torch.randn(5, seq, columns))
    assert out.shape == (5, future * columns)
    out.sum().backward()
    # DDP without find_unused_parameters needs every parameter in every step's graph (post 002's trap).
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("name", SEQUENCE_MODELS)
def test_forecasts_are_changes_from_the_last_row(name):
    torch.manual_seed(0)
    model = build_model(name, (6, 2), 3 * 2).eval()
    with torch.no_grad():
        for p in model.head.parameters():
            p.zero_()  # no change predicted: the forecast is the last row, three times
        x = torch.randn(4, 6, 2)
        assert torch.equal(model(x), x[:, -1, :].repeat(1, 3))


@pytest.mark.parametrize("name", SEQUENCE_MODELS)
def test_initialisation_is_deterministic_given_the_seed(name):
    states = []
    for _ in range(2):
        torch.manual_seed(7)
        states.append(build_model(name, (12, 3), 6).state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_sequence_and_image_models_refuse_each_others_data():
    assert model_input_kind("lstm") == model_input_kind("tst") == "sequence"
    with pytest.raises(UsageError) as excinfo:
        load("digits")
    assert str(excinfo.value) == (
        "data 'digits' is not a time series, which sequence models (lstm, tst) need: use --data timeseries:co2, "
        "timeseries:macro or timeseries:CSV, or another --model for this data"
    )
    with pytest.raises(UsageError, match="model 'lstm' needs timeseries windows shaped"):
        build_model("lstm", (1, 8, 8), 10)
    with pytest.raises(UsageError, match="which image models cannot take: use --model lstm, --model tst"):
        load_data("timeseries:co2", input_kind="image", image_size=32)


# --- embedded series --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_embedded_series_shape_header_and_checksum(name):
    shape, header, checksum = EMBEDDED[name]
    packed = importlib.resources.files("multigpu.train.data").joinpath("series", f"{name}.csv.gz").read_bytes()
    text = gzip.decompress(packed).decode("ascii")
    assert text.splitlines()[0] == header
    assert hashlib.sha256(text.encode()).hexdigest() == checksum
    bundle = load(f"timeseries:{name}", seq_length=12, future_length=4)
    assert tuple(bundle.train.series.shape) == shape
    assert bundle.input_shape == (12, shape[1]) and bundle.num_outputs == 4 * shape[1]
    assert torch.isfinite(bundle.train.series).all()


def test_embedded_co2_starts_and_ends_with_the_published_weeks():
    bundle = load("timeseries:co2", seq_length=12, future_length=1)
    original = bundle.train.series[:, 0] * bundle.train.std + bundle.train.mean
    assert original[:2].tolist() == pytest.approx([316.1, 317.3], abs=1e-3)  # 29 March and 5 April 1958


# --- the split by time ------------------------------------------------------------------------------


@pytest.mark.parametrize("seq, future", [(1, 1), (5, 2), (12, 4), (40, 8)])
def test_no_validation_target_was_a_training_target(tmp_path, seq, future):
    rows = 200
    path = tmp_path / "rows.csv"
    path.write_text("row\n" + "".join(f"{i}\n" for i in range(rows)))  # each value is its row number
    bundle = load(f"timeseries:{path}", seq_length=seq, future_length=future)

    def target_rows(dataset):
        return {round(float(v)) for i in range(len(dataset)) for v in dataset[i][1] * dataset.std + dataset.mean}

    train, val = target_rows(bundle.train), target_rows(bundle.val)
    assert max(train) < min(val)
    assert max(val) == rows - 1  # the last row is scored
    assert min(val) == max(train) + 1  # and no row between them is lost
    # Standardised with the rows the training windows read, none after them.
    read = np.arange(len(bundle.train) + seq + future - 1, dtype=np.float64)
    assert float(bundle.train.mean) == pytest.approx(read.mean())
    windows = rows - seq - future + 1
    assert len(bundle.train) + len(bundle.val) == windows - (future - 1)
    assert len(bundle.val) == windows - (future - 1) - int((windows - (future - 1)) * 0.8)


# --- val_mae / val_rmse in original units -----------------------------------------------------------


class Off(torch.nn.Module):
    """Predicts the target plus `offsets` (normalised units): the window's y rides along in x."""

    def __init__(self, offsets: torch.Tensor):
        super().__init__()
        self.offsets = offsets

    def forward(self, x):
        return x + self.offsets


def test_error_off_by_c_normalised_units_is_c_times_std_in_original_units():
    rt = multigpu.setup("single", accelerator="cpu")
    y = torch.randn(10, 4)
    batches = [(y[:6], y[:6]), (y[6:], y[6:])]  # x = y, so the model's error is exactly its offsets
    std = torch.tensor([2.0, 2.0, 10.0, 10.0])  # e.g. 2 rows x 2 columns, flattened row by row
    c = 0.5
    result = evaluate(rt, Off(torch.full((4,), c)), torch.nn.functional.mse_loss, batches, False,
                      StepSettings(), target_std=std)
    assert result["val_samples"] == 10
    assert result["val_loss"] == pytest.approx(c**2)
    assert result["val_mae"] == pytest.approx(c * 6.0)  # mean of c*2, c*2, c*10, c*10
    assert result["val_rmse"] == pytest.approx(c * math.sqrt((4 + 4 + 100 + 100) / 4))
    signs = Off(torch.tensor([c, -c, c, -c]))  # the sign of an error does not matter
    again = evaluate(rt, signs, torch.nn.functional.mse_loss, batches, False, StepSettings(), target_std=std)
    assert (again["val_mae"], again["val_rmse"]) == pytest.approx((result["val_mae"], result["val_rmse"]))
    plain = evaluate(rt, signs, torch.nn.functional.mse_loss, batches, False, StepSettings())
    assert "val_mae" not in plain and "val_rmse" not in plain


def test_train_loaders_read_windows_a_batch_at_a_time_with_the_same_values():
    from torch.utils.data import default_collate

    from multigpu.train.data.datasets import BatchedWindows, load_data
    from multigpu.train.training import make_loader

    data = load_data("timeseries:co2", input_kind="sequence", image_size=None, seq_length=12, future_length=3)
    loader = make_loader(data.train, 16, shuffle=False, workers=0)
    assert isinstance(loader.dataset, BatchedWindows)
    for k, (x, y) in enumerate(loader):
        ex, ey = default_collate([data.train[i] for i in range(16 * k, min(16 * (k + 1), len(data.train)))])
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert x.shape[1:] == (12, data.input_shape[1]) and y.shape[1] == data.num_outputs
    with pytest.raises(IndexError, match="out of range"):
        data.train.batch([0, len(data.train)])
    plain = torch.utils.data.DataLoader(data.train, batch_size=4)  # a user's own loader: samples as ever
    assert next(iter(plain))[0].shape == (4, 12, data.input_shape[1])
