"""Data for `multigpu train --data SPEC`.

`load_data(spec, input_kind=..., image_size=...)` turns one of four specs into a `DataBundle`:

- `digits`: the 8x8 handwritten digits of UCI's Optical Recognition of Handwritten Digits set
  (1797 samples, 10 classes), shape (1, 8, 8), shipped in the package (data_files/digits.npz, the
  same arrays as scikit-learn's `load_digits()`).
  Fixed stratified split with no randomness: within each class, every fifth sample goes to
  validation, which gives exactly 1442 training and 355 validation samples.
- `synthetic:N`: N generated training samples, 10 classes, shape (3, S, S) for image models
  (S = --image-size) or (32,) for flat ones. Sample i is drawn from a generator seeded by i, so
  nothing is held in memory and any rank or worker can produce any sample. The validation set
  (max(64, min(N // 5, 2000)) samples) has its own fixed seeds: it never depends on --seed.
- `folder:PATH`: images in `PATH/train/<class>/*.jpg` and `PATH/val/<class>/*.jpg` (ImageFolder
  layout; classes are the sorted folder names under train/). Training images get a random resized
  crop and a random flip; validation images are resized and centre-cropped.
- `shards:DIR` or `shards:train=PATTERN,val=PATTERN`: the same images packed into WebDataset tar
  shards (shards.py), read at random through an index of their offsets, augmented as `folder:`.
- `timeseries:CSV`: a numeric CSV (header row optional), or `timeseries:co2` / `timeseries:macro`,
  two small public-domain series shipped inside the package (series/SOURCE.md). Windows of
  `seq_length` rows, shape (seq_length, columns), predict the next `future_length` rows flattened.
  The split is by time: the first 80% of windows train, the last 20% validate, and the
  `future_length - 1` windows between them are left out, so that no row a validation window is
  scored on is a row some training window was trained to predict (validation inputs may read
  earlier rows: that is the history known at forecast time). All values are standardised with the
  mean and std of the rows the training windows read (kept as `.mean` and `.std` on both datasets,
  and per output as `DataBundle.target_scale`, to report errors in the original units).

Every dataset is map-style and picklable, so DataLoader workers can use it. Random augmentation
draws from torch's global RNG, which DataLoader seeds differently in each worker.
"""

from __future__ import annotations

import csv
import gzip
import importlib.resources
import io
import math
import os
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from multigpu.train.data.data_bundle import DataBundle
from multigpu.train.data.data_specs import check_spec
from multigpu.core.errors import UsageError
from multigpu.train.models.model_names import check_input_kind  # noqa: F401 (the CLI imports it from there)

# Series shipped in multigpu/train/series/ (SOURCE.md there): `timeseries:NAME` reads them, not a file NAME.
EMBEDDED_SERIES = ("co2", "macro")

# Pixel mean and std of the digits set once scaled to [0, 1]; fixed so they never depend on the split.
DIGITS_MEAN, DIGITS_STD = 0.3053, 0.3760

SYNTHETIC_CLASSES = 10
SYNTHETIC_FLAT_FEATURES = 32
_SYNTHETIC_TEACHER_SEED = 20240601
_TRAIN_STREAM, _VAL_STREAM = 0, 1
# torch seeds its CPU generator from the low 32 bits only, so sample seeds are 2 * index + stream.
_SYNTHETIC_MAX = 2**31


def load_data(
    spec: str, *, input_kind: str, image_size: int, seq_length: int = 12, future_length: int = 1,
    bad_images: str = "skip",
) -> DataBundle:
    """Build the DataBundle for `--data SPEC`; `input_kind` is models.model_input_kind() of the model."""
    check_input_kind(spec, input_kind)
    check_spec(spec)  # what is a spec is decided in one place (data_specs), also before a launch
    kind, _, arg = spec.partition(":")
    if spec == "digits":
        return _digits()
    if kind == "synthetic":
        return _synthetic(spec, arg, input_kind, _positive(image_size, "--image-size"))
    if kind == "folder":
        from multigpu.train.data.imagefolder import load_folder

        return load_folder(arg, _positive(image_size, "--image-size"), bad_images=bad_images)
    if kind == "shards":
        from multigpu.train.data.shards import load_shards

        return load_shards(arg, _positive(image_size, "--image-size"), bad_images=bad_images)
    seq = _positive(seq_length, "--seq-length")  # timeseries:
    return _timeseries(arg, seq, _positive(future_length, "--future-length"))


def _positive(value: int, flag: str) -> int:
    if not isinstance(value, int) or value < 1:
        example = {"--image-size": 32, "--seq-length": 12}.get(flag, 1)
        raise UsageError(f"{flag} {value} is not a positive integer: pass a value of 1 or more, e.g. {flag} {example}")
    return value


# --- digits -----------------------------------------------------------------------------------------


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as shipped: pixels (1797, 8, 8) uint8 in 0..16, labels (1797,) uint8."""
    with (resources.files("multigpu.train.data") / "data_files" / "digits.npz").open("rb") as fh:
        with np.load(fh, allow_pickle=False) as npz:
            return npz["images"], npz["labels"]


def _digits() -> DataBundle:
    pixels, labels = digits_arrays()
    x = (pixels.reshape(len(pixels), 64).astype(np.float32) / 16.0 - DIGITS_MEAN) / DIGITS_STD
    y = labels.astype(np.int64)
    val_mask = np.zeros(len(y), dtype=bool)
    for label in np.unique(y):
        members = np.flatnonzero(y == label)
        val_mask[members[4::5]] = True
    images = torch.from_numpy(x).view(-1, 1, 8, 8)
    labels = torch.from_numpy(y)
    train_idx = torch.from_numpy(np.flatnonzero(~val_mask))
    val_idx = torch.from_numpy(np.flatnonzero(val_mask))
    return DataBundle(
        train=TensorDataset(images[train_idx], labels[train_idx]),
        val=TensorDataset(images[val_idx], labels[val_idx]),
        task="classification",
        input_shape=(1, 8, 8),
        num_outputs=10,
        name="digits",
    )


# --- synthetic --------------------------------------------------------------------------------------


class SyntheticDataset(Dataset):
    """Sample i: a label from a generator seeded by (i, stream), and an input = noise + that label's template.

    The templates are fixed random patterns, coarse (4x4 per channel, upscaled) for images so that
    convnets with global pooling can learn them as well as linear models can. The noise is strong
    enough that a flat model needs training to separate the classes, weak enough that high accuracy
    is reachable. Inputs have roughly unit variance.
    """

    def __init__(self, length: int, shape: tuple[int, ...], stream: int) -> None:
        self.length, self.shape, self.stream = length, shape, stream
        teacher = torch.Generator().manual_seed(_SYNTHETIC_TEACHER_SEED)
        if len(shape) == 3:
            coarse = torch.randn(SYNTHETIC_CLASSES, shape[0], 4, 4, generator=teacher)
            templates = F.interpolate(coarse, size=shape[1:], mode="nearest")
        else:
            templates = torch.randn(SYNTHETIC_CLASSES, *shape, generator=teacher)
        # Noise std 2.5 times the templates' std of 1, then everything scaled to unit variance.
        # Uniform noise has the same variance as Gaussian would and is about twice as fast to draw,
        # which matters at 224x224, where drawing it is what a DataLoader worker spends its time on.
        norm = math.sqrt(1.0 + 2.5**2)
        self.noise_scale = math.sqrt(12.0) * 2.5 / norm  # U(0, 1) has std 1/sqrt(12)
        self.offsets = templates / norm - 0.5 * self.noise_scale  # template plus the noise's centring shift

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        rng = torch.Generator().manual_seed(2 * index + self.stream)
        label = int(torch.randint(SYNTHETIC_CLASSES, (1,), generator=rng))
        x = torch.rand(self.shape, generator=rng)
        torch.add(self.offsets[label], x, alpha=self.noise_scale, out=x)  # in place: no second 600 KB buffer
        return x, torch.tensor(label, dtype=torch.int64)


def _synthetic(spec: str, count: str, input_kind: str, image_size: int) -> DataBundle:
    n = int(count) if count.isascii() and count.isdigit() else 0
    if not 1 <= n <= _SYNTHETIC_MAX:
        raise UsageError(
            f"bad data spec {spec!r}: N must be a positive integer up to {_SYNTHETIC_MAX}, as in synthetic:5000"
        )
    shape = (3, image_size, image_size) if input_kind == "image" else (SYNTHETIC_FLAT_FEATURES,)
    return DataBundle(
        train=SyntheticDataset(n, shape, _TRAIN_STREAM),
        val=SyntheticDataset(max(64, min(n // 5, 2000)), shape, _VAL_STREAM),
        task="classification",
        input_shape=shape,
        num_outputs=SYNTHETIC_CLASSES,
        name=f"synthetic:{n}",
    )


# --- timeseries -------------------------------------------------------------------------------------


class WindowDataset(Dataset):
    """Window i: x = rows [t, t+seq) of the series, y = rows [t+seq, t+seq+future) flattened, t = start + i."""

    def __init__(self, series: torch.Tensor, start: int, count: int, seq: int, future: int, mean, std) -> None:
        self.series, self.start, self.count, self.seq, self.future = series, start, count, seq, future
        self.mean, self.std = mean, std  # per column: original = standardised * std + mean

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(f"index {index} out of range for {self.count} windows")
        t = self.start + index
        x = self.series[t : t + self.seq]
        y = self.series[t + self.seq : t + self.seq + self.future].reshape(-1)
        return x, y

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows `indices` stacked, (B, seq, columns) and (B, future * columns), by two gathers
        of rows instead of B slices and a collate. index_select, not advanced indexing: in a
        profile of post 002's LSTM on 2x H200 the advanced-indexing gather took 0.43 ms a call on
        the host (docs/performance.md); index_select of the flattened rows was 1.4-11x
        faster on CPU at 1 to 16 intra-op threads."""
        t = torch.as_tensor(indices, dtype=torch.int64)
        if len(t) and not (0 <= int(t.min()) and int(t.max()) < self.count):
            raise IndexError(f"indices {int(t.min())}..{int(t.max())} out of range for {self.count} windows")
        t = t + self.start
        columns = self.series.shape[1]
        rows = (t[:, None] + torch.arange(self.seq)).reshape(-1)
        x = self.series.index_select(0, rows).view(len(t), self.seq, columns)
        rows = (t[:, None] + self.seq + torch.arange(self.future)).reshape(-1)
        y = self.series.index_select(0, rows).view(len(t), self.future * columns)
        return x, y


class BatchedWindows(Dataset):
    """A WindowDataset that `multigpu train`'s loaders read a batch at a time: DataLoader calls
    __getitems__ with a batch's indices, and `collate` passes the batch on. Small models' steps are
    short (post 002's), and per-sample slicing and collating is the loader's share of them. Only
    the loaders multigpu builds use it: a DataLoader with the default collate_fn over it would
    get a batch where it expects samples."""

    batched_reads = True  # no randomness: loaders.PerSampleSeed may read it a batch at a time

    def __init__(self, windows: WindowDataset) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int):
        return self.windows[index]

    def __getitems__(self, indices: list[int]):
        return self.windows.batch(indices)

    @staticmethod
    def collate(batch):
        return batch if isinstance(batch, tuple) else torch.utils.data.default_collate(batch)


def _read_numeric_csv(path: str) -> np.ndarray:
    if path in EMBEDDED_SERIES:
        packed = importlib.resources.files("multigpu.train.data").joinpath("series", f"{path}.csv.gz")
        packed = packed.read_bytes()
        handle = io.StringIO(gzip.decompress(packed).decode("ascii"), newline="")
    elif os.path.isfile(path):
        handle = open(path, newline="")
    else:
        raise UsageError(f"timeseries file '{path}' does not exist: check the path in --data timeseries:{path}")
    with handle:
        rows = [row for row in csv.reader(handle) if row and any(cell.strip() for cell in row)]
    if not rows:
        raise UsageError(f"timeseries file '{path}' is empty: it needs one numeric column per feature")

    def numeric(cell: str) -> bool:
        try:
            return math.isfinite(float(cell))
        except ValueError:
            return False

    header = None if all(numeric(cell) for cell in rows[0]) else [cell.strip() for cell in rows[0]]
    body = rows[1:] if header else rows
    width = len(rows[0])
    values = np.empty((len(body), width), dtype=np.float64)
    for number, row in enumerate(body, start=2 if header else 1):
        if len(row) != width:
            raise UsageError(
                f"timeseries file '{path}' row {number} has {len(row)} values but the first row has {width}: "
                "give every row the same columns"
            )
        for column, cell in enumerate(row):
            if not numeric(cell):
                label = f"'{header[column]}'" if header else f"{column + 1}"
                raise UsageError(
                    f"timeseries file '{path}' column {label} holds a non-numeric value {cell.strip()!r} "
                    f"(row {number}): keep only numeric columns, e.g. drop or encode column {label}"
                )
            values[number - (2 if header else 1), column] = float(cell)
    return values


def _timeseries(path: str, seq: int, future: int) -> DataBundle:
    values = _read_numeric_csv(path)
    rows, columns = values.shape
    windows = rows - seq - future + 1
    gap = future - 1  # windows whose targets would overlap both the training and the validation ones
    if windows - gap < 2:  # one window to train on and one to validate
        raise UsageError(
            f"timeseries file '{path}' has {rows} data rows, but --seq-length {seq} and --future-length {future} "
            f"need at least {seq + 2 * future} (one training and one validation window): "
            "add rows or lower --seq-length"
        )
    n_train = min(max(1, int((windows - gap) * 0.8)), windows - gap - 1)
    covered = values[: n_train + seq + future - 1]  # every row some training window reads
    mean = covered.mean(axis=0)
    std = covered.std(axis=0)
    std[std == 0] = 1.0  # a constant column stays constant instead of becoming NaN
    series = torch.from_numpy((values - mean) / std).float()
    mean_t, std_t = torch.from_numpy(mean).float(), torch.from_numpy(std).float()
    return DataBundle(
        train=WindowDataset(series, 0, n_train, seq, future, mean_t, std_t),
        val=WindowDataset(series, n_train + gap, windows - gap - n_train, seq, future, mean_t, std_t),
        task="regression",
        input_shape=(seq, columns),
        num_outputs=future * columns,
        name=f"timeseries:{path}",
        target_scale=(mean_t.repeat(future), std_t.repeat(future)),  # y is `future` rows, flattened
    )
