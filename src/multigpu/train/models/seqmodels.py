"""Sequence models for `timeseries:` windows: `lstm` and `tst` (a small transformer encoder).

Both take x of shape (batch, seq_length, columns) and return (batch, future_length * columns): the
next future_length rows of every column, flattened row by row as the windows' targets are.

Both forecast the change from the last row they were given: the output is that row repeated
future_length times plus what the network adds. A time split puts validation after training, so
a trending series (CO2, GDP) validates on values above any it trained on; a network that had to
produce the level itself would saturate there, one that adds a change to the last level does not.

Every parameter takes part in every forward pass (DDP needs no find_unused_parameters), and every
initial weight is drawn from torch's global RNG, so one `torch.manual_seed` gives every rank the
same model. The LSTM runs as one cuDNN call on GPUs (batch_first, contiguous weights).
"""
from __future__ import annotations

import torch
from torch import nn

from multigpu.core.errors import UsageError
from multigpu.train.models.model_names import SEQUENCE_MODELS


def build_sequence_model(name: str, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """`name` ("lstm" or "tst") for windows shaped (seq_length, columns) predicting `num_outputs` values."""
    assert name in SEQUENCE_MODELS, f"not a sequence model: {name!r}"
    if len(input_shape) != 2 or num_outputs % input_shape[1]:
        raise UsageError(
            f"model {name!r} needs timeseries windows shaped (seq_length, columns) predicting whole rows, but "
            f"the data gives samples shaped {input_shape} with {num_outputs} outputs: use --data timeseries:CSV"
        )
    seq_length, columns = input_shape
    if name == "lstm":
        return LSTMForecaster(columns, num_outputs // columns)
    return TransformerForecaster(seq_length, columns, num_outputs // columns)


class _LastRowPlusChange(nn.Module):
    """Base: forward(x) = last row of x, repeated `future` times, + head(features(x))."""

    def __init__(self, columns: int, future: int) -> None:
        super().__init__()
        self.columns, self.future = columns, future

    def features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        change = self.head(self.features(x))
        return x[:, -1, :].repeat(1, self.future) + change


class LSTMForecaster(_LastRowPlusChange):
    """A 2-layer LSTM read at its last step, then a linear head to future_length rows."""

    def __init__(self, columns: int, future: int, hidden: int = 64, layers: int = 2) -> None:
        super().__init__(columns, future)
        self.lstm = nn.LSTM(columns, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, future * columns)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return out[:, -1, :]


class TransformerForecaster(_LastRowPlusChange):
    """Rows projected to d_model, plus a learned position embedding, through a pre-norm transformer
    encoder; the last position's output goes to a linear head."""

    def __init__(self, seq_length: int, columns: int, future: int, d_model: int = 64, heads: int = 4,
                 layers: int = 2) -> None:
        super().__init__(columns, future)
        self.embed = nn.Linear(columns, d_model)
        self.position = nn.Parameter(torch.randn(seq_length, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=2 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        # No nested tensors: there is no padding mask, and pre-norm layers cannot use them anyway.
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(d_model, future * columns)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x) + self.position)  # the position embedding fixes seq_length
        return h[:, -1, :]
