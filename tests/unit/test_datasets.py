"""Data specs: digits split, synthetic determinism, ImageFolder layout, timeseries windows, error messages."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest
import torch

from multigpu.train.data import imagefolder
from multigpu.train.data.datasets import load_data
from multigpu.core.errors import UsageError

# torchvision's path runs where torchvision imports (the GPU machines), PIL's everywhere
DECODERS_HERE = ["pil"] + (["torchvision"] if imagefolder.default_decoder() == "torchvision" else [])


def load(spec, input_kind="image", image_size=32, **kwargs):
    return load_data(spec, input_kind=input_kind, image_size=image_size, **kwargs)


def labels(dataset) -> list[int]:
    return [int(dataset[i][1]) for i in range(len(dataset))]


# --- digits -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("input_kind", ["flat", "image"])
def test_digits_fixed_split_and_shapes(input_kind):
    bundle = load("digits", input_kind=input_kind, image_size=224)
    assert (len(bundle.train), len(bundle.val)) == (1442, 355)
    assert (bundle.task, bundle.input_shape, bundle.num_outputs) == ("classification", (1, 8, 8), 10)
    assert bundle.name == "digits"
    x, y = bundle.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.int64
    counts = np.bincount(labels(bundle.val), minlength=10)
    assert counts.min() >= 34 and counts.max() <= 37  # stratified: every fifth sample of each class
    features = torch.stack([bundle.train[i][0] for i in range(len(bundle.train))])
    assert abs(float(features.mean())) < 0.05 and abs(float(features.std()) - 1) < 0.05


def test_digits_split_is_identical_across_calls_and_seeds():
    torch.manual_seed(1)
    first = load("digits").val
    torch.manual_seed(2)
    second = load("digits").val
    assert torch.equal(first.tensors[0], second.tensors[0])


# SHA-256 of the split's tensors as scikit-learn's load_digits() gave them before the data shipped
# in the package (x: float32 (N, 1, 8, 8), y: int64 (N,)): the bundled file changes no value.
DIGITS_SHA256 = {
    "train": ("83f785ba7ed8e52670068a69ef1da6e3d2433271aa63781ed587929c8f225006",
              "9313721fa010b4068efd8523f8b0ad55e16fe55564ccc54da13abb96858f7b54"),
    "val": ("af325fb465bfb50d7208b050363c35d71bb0004cfba597fe4842cea5572a0769",
            "ee6ec0ae7823271abdaa9092fefe38ec720e2d13d041a0541dbd4099bda0fc56"),
}


def test_bundled_digits_match_the_fixed_checksums():
    bundle = load("digits")
    for split, dataset in (("train", bundle.train), ("val", bundle.val)):
        x, y = dataset.tensors
        got = (hashlib.sha256(x.numpy().tobytes()).hexdigest(),
               hashlib.sha256(y.numpy().tobytes()).hexdigest())
        assert got == DIGITS_SHA256[split], split


def test_bundled_digits_are_scikit_learns():
    import sklearn.datasets as sklearn_datasets  # the dev extra brings it: a failure, not a skip
    from multigpu.train.data.datasets import digits_arrays

    reference = sklearn_datasets.load_digits()
    pixels, labels = digits_arrays()
    assert np.array_equal(pixels.reshape(-1, 64), reference.data)
    assert np.array_equal(labels, reference.target)
    assert pixels.dtype == labels.dtype == np.uint8


# --- synthetic --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("input_kind", "image_size", "shape"), [("image", 32, (3, 32, 32)), ("image", 8, (3, 8, 8)), ("flat", 32, (32,))]
)
def test_synthetic_shapes(input_kind, image_size, shape):
    bundle = load("synthetic:500", input_kind=input_kind, image_size=image_size)
    assert (bundle.task, bundle.input_shape, bundle.num_outputs) == ("classification", shape, 10)
    assert bundle.name == "synthetic:500"
    assert (len(bundle.train), len(bundle.val)) == (500, 100)
    x, y = bundle.train[3]
    assert x.shape == shape and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.int64 and 0 <= int(y) < 10


def test_synthetic_is_deterministic_and_independent_of_the_global_seed():
    torch.manual_seed(1)
    first = load("synthetic:100")
    torch.manual_seed(2)
    second = load("synthetic:5000")
    for i in [0, 7, 63]:
        assert torch.equal(first.train[i][0], second.train[i][0])  # sample i depends on i only
        assert torch.equal(first.val[i][0], second.val[i][0])
    assert labels(first.val) == labels(second.val)[:64]
    assert not torch.equal(first.train[0][0], first.train[1][0])
    assert not torch.equal(first.train[0][0], first.val[0][0])  # train and val draw from separate streams


def test_synthetic_validation_size_is_bounded():
    assert len(load("synthetic:10").val) == 64
    assert len(load("synthetic:1000000", image_size=224).val) == 2000


def test_synthetic_dataset_is_picklable_and_lazy():
    train = load("synthetic:1000000", image_size=224).train
    restored = pickle.loads(pickle.dumps(train))
    assert len(pickle.dumps(train)) < 20_000_000  # a few fixed templates, not a million images
    assert torch.equal(restored[999_999][0], train[999_999][0])
    with pytest.raises(IndexError):
        train[1_000_000]


def test_synthetic_is_learnable_by_a_linear_model():
    # Nearest class mean fitted on training data beats chance (10%) by far on validation data.
    bundle = load("synthetic:2000", input_kind="flat")
    x = torch.stack([bundle.train[i][0] for i in range(2000)])
    y = torch.tensor(labels(bundle.train))
    means = torch.stack([x[y == c].mean(0) for c in range(10)])
    xv = torch.stack([bundle.val[i][0] for i in range(len(bundle.val))])
    accuracy = (torch.cdist(xv, means).argmin(1) == torch.tensor(labels(bundle.val))).float().mean()
    assert accuracy > 0.5


@pytest.mark.parametrize(
    "spec", ["synthetic:abc", "synthetic:0", "synthetic:", "synthetic:-5", "synthetic:1.5", "synthetic:9999999999"]
)
def test_synthetic_bad_count(spec):
    with pytest.raises(UsageError) as excinfo:
        load(spec)
    assert str(excinfo.value) == (
        f"bad data spec '{spec}': N must be a positive integer up to 2147483648, as in synthetic:5000"
    )


# --- folder -----------------------------------------------------------------------------------------


@pytest.fixture(params=DECODERS_HERE)
def decoder(request, monkeypatch):
    monkeypatch.setattr(imagefolder, "default_decoder", lambda: request.param)
    return request.param


def make_image_folder(root, classes=("cat", "dog"), per_class=3, splits=("train", "val")):
    from PIL import Image

    for split in splits:
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                color = (200 * c, 40 * i, 100)
                Image.new("RGB", (40 + 7 * i, 30), color).save(folder / f"{i}.{'png' if i % 2 else 'jpg'}")
    return root


def test_folder_shapes_labels_and_classes(tmp_path, decoder):
    make_image_folder(tmp_path)
    bundle = load(f"folder:{tmp_path}", image_size=24)
    assert bundle.train.decoder == bundle.val.decoder == decoder
    assert (bundle.task, bundle.input_shape, bundle.num_outputs) == ("classification", (3, 24, 24), 2)
    assert bundle.train.classes == ["cat", "dog"]
    assert (len(bundle.train), len(bundle.val)) == (6, 6)
    assert labels(bundle.train) == [0, 0, 0, 1, 1, 1] and labels(bundle.val) == [0, 0, 0, 1, 1, 1]
    for dataset in (bundle.train, bundle.val):
        x, y = dataset[0]
        assert x.shape == (3, 24, 24) and x.dtype == torch.uint8 and y.dtype == torch.int64
    # A solid colour image keeps its pixels (red channel 0 for "cat"); the GPU normalises later.
    assert torch.equal(bundle.val[0][0][0], torch.zeros(24, 24, dtype=torch.uint8))
    assert bundle.normalize == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    pickle.loads(pickle.dumps(bundle.train))


def test_folder_augmentation_follows_torch_rng(tmp_path, decoder):
    from PIL import Image

    make_image_folder(tmp_path)
    Image.fromarray(np.arange(48 * 64 * 3, dtype=np.uint8).reshape(48, 64, 3)).save(tmp_path / "train/cat/0.png")
    (tmp_path / "train/cat/0.jpg").unlink()  # so the gradient image is sample 0
    train = load(f"folder:{tmp_path}", image_size=16).train
    torch.manual_seed(5)
    first = train[0][0]
    torch.manual_seed(5)
    assert torch.equal(train[0][0], first)
    assert any(not torch.equal(train[0][0], first) for _ in range(5))


def test_folder_errors(tmp_path):
    with pytest.raises(UsageError, match=r"^data folder '.*nowhere' does not exist: check the path in --data folder:"):
        load(f"folder:{tmp_path / 'nowhere'}")
    make_image_folder(tmp_path / "a", splits=("train",))
    with pytest.raises(UsageError) as excinfo:
        load(f"folder:{tmp_path / 'a'}")
    assert str(excinfo.value) == (
        f"data folder '{tmp_path / 'a'}' has no val/ subfolder: "
        "expected PATH/train/<class>/<image> and PATH/val/<class>/<image>"
    )
    make_image_folder(tmp_path / "b")
    (tmp_path / "b/train/empty").mkdir()
    with pytest.raises(UsageError) as excinfo:
        load(f"folder:{tmp_path / 'b'}")
    assert str(excinfo.value) == (
        f"class folder '{tmp_path / 'b/train/empty'}' has no images: add .jpg/.png files to it or remove the folder"
    )
    make_image_folder(tmp_path / "c")
    make_image_folder(tmp_path / "c", classes=("zebra",), splits=("val",))
    with pytest.raises(UsageError, match=r"has class folders missing from train/ \(zebra\): val/ must use the same"):
        load(f"folder:{tmp_path / 'c'}")


# --- timeseries -------------------------------------------------------------------------------------


def write_csv(path, rows, header=None):
    lines = ([",".join(header)] if header else []) + [",".join(str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("header", [None, ["temp", "load"]])
def test_timeseries_windows_split_and_standardisation(tmp_path, header):
    values = np.stack([np.arange(30.0), 100.0 + 3.0 * np.arange(30.0)], axis=1)  # 30 rows, 2 columns
    path = write_csv(tmp_path / "series.csv", values.tolist(), header)
    bundle = load(f"timeseries:{path}", input_kind="flat", seq_length=5, future_length=2)
    assert (bundle.task, bundle.input_shape, bundle.num_outputs) == ("regression", (5, 2), 4)
    # 24 windows; the one between the splits (future_length - 1) is left out: of the other 23,
    # the first 18 (80%, rounded down) train and the last 5 validate.
    windows = 30 - 5 - 2 + 1
    assert (len(bundle.train), len(bundle.val)) == (18, 5)
    x, y = bundle.train[0]
    assert x.shape == (5, 2) and y.shape == (4,) and x.dtype == y.dtype == torch.float32
    # Training windows read rows 0..23: standardised with their mean and std.
    covered = values[: 18 + 5 + 2 - 1]
    expected = (values - covered.mean(0)) / covered.std(0)
    assert torch.allclose(x, torch.tensor(expected[0:5], dtype=torch.float32), atol=1e-5)
    assert torch.allclose(y, torch.tensor(expected[5:7].reshape(-1), dtype=torch.float32), atol=1e-5)
    last_x, last_y = bundle.val[len(bundle.val) - 1]
    assert torch.allclose(last_y, torch.tensor(expected[28:30].reshape(-1), dtype=torch.float32), atol=1e-5)
    assert torch.allclose(last_x * bundle.val.std + bundle.val.mean, torch.tensor(values[23:28], dtype=torch.float32))
    assert windows == len(bundle.train) + 1 + len(bundle.val)
    mean, std = bundle.target_scale
    assert torch.equal(mean, bundle.val.mean.repeat(2)) and torch.equal(std, bundle.val.std.repeat(2))


def test_timeseries_errors(tmp_path):
    missing = tmp_path / "missing.csv"
    with pytest.raises(UsageError) as excinfo:
        load(f"timeseries:{missing}", input_kind="flat")
    assert str(excinfo.value) == (
        f"timeseries file '{missing}' does not exist: check the path in --data timeseries:{missing}"
    )
    short = write_csv(tmp_path / "short.csv", [[i, i] for i in range(13)])
    with pytest.raises(UsageError) as excinfo:
        load(f"timeseries:{short}", input_kind="flat")
    assert str(excinfo.value) == (
        f"timeseries file '{short}' has 13 data rows, but --seq-length 12 and --future-length 1 need at least 14 "
        "(one training and one validation window): add rows or lower --seq-length"
    )
    dated = write_csv(tmp_path / "dated.csv", [["2024-01-01", 1.0], ["2024-01-02", 2.0]], ["date", "value"])
    with pytest.raises(UsageError) as excinfo:
        load(f"timeseries:{dated}", input_kind="flat")
    assert str(excinfo.value) == (
        f"timeseries file '{dated}' column 'date' holds a non-numeric value '2024-01-01' (row 2): "
        "keep only numeric columns, e.g. drop or encode column 'date'"
    )
    ragged = write_csv(tmp_path / "ragged.csv", [[1, 2], [3]])
    with pytest.raises(UsageError, match="row 2 has 1 values but the first row has 2: give every row the same columns"):
        load(f"timeseries:{ragged}", input_kind="flat")
    with pytest.raises(UsageError, match="image models cannot take: use --model lstm, --model tst, --model mlp"):
        load(f"timeseries:{short}", input_kind="image")


# --- spec and flag errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["mnist", "folder:", "timeseries:", "digits:5", ""])
def test_unknown_spec_lists_the_forms(spec):
    with pytest.raises(UsageError) as excinfo:
        load(spec)
    assert str(excinfo.value) == (
        f"unknown data spec {spec!r}: use one of digits, synthetic:N (e.g. synthetic:5000), "
        "folder:PATH (ImageFolder layout), shards:DIR (WebDataset tar shards), timeseries:CSV"
    )


def test_bad_image_size():
    with pytest.raises(UsageError) as excinfo:
        load("synthetic:10", image_size=0)
    assert str(excinfo.value) == (
        "--image-size 0 is not a positive integer: pass a value of 1 or more, e.g. --image-size 32"
    )


def _image_folder(root, bad=()):
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (12, 12), (60 * i, 0, 0)).save(root / split / cls / f"{i}.png")
    for rel in bad:
        (root / rel).write_bytes(b"\x89PNG broken")


def test_an_unreadable_image_is_replaced_by_the_next_counted_and_named_once(tmp_path, decoder, capsys):
    _image_folder(tmp_path, bad=["train/a/1.png"])
    data = load_data(f"folder:{tmp_path}", input_kind="image", image_size=8)
    bad_index = [p for p, _ in data.train.samples].index(str(tmp_path / "train/a/1.png"))
    x, y = data.train[bad_index]
    nxt, label = data.train[bad_index + 1]
    assert torch.equal(x, nxt) and y == label, "the next image of the split takes its place"
    data.train[bad_index]
    assert data.train.bad_count == 2, "counted each time it is met"
    err = capsys.readouterr().err
    assert err.count("skipped unreadable image") == 1 and "train/a/1.png" in err


def test_unreadable_images_are_counted_in_their_own_epoch_while_workers_run_ahead(tmp_path):
    """2 workers x prefetch 2 make 4 batches of epoch 1 before epoch 0's last is handed out
    (loaders.EpochAfterEpoch); those batches' bad files are epoch 1's, not epoch 0's."""
    from torch.utils.data import DataLoader

    from multigpu.core.loading.loaders import shard_loader

    _image_folder(tmp_path, bad=["train/a/0.png", "train/a/1.png", "train/b/0.png"])
    train = load_data(f"folder:{tmp_path}", input_kind="image", image_size=8).train
    loader = shard_loader(DataLoader(train, batch_size=1, shuffle=True, num_workers=2), layout=(1, 0, 1),
                          device=torch.device("cpu"), seed=0, on_step=lambda info: None)
    loader.set_last_epoch(2)
    counts = []
    for epoch in range(3):
        assert len(list(loader)) == 6
        counts.append(train.take_bad_count(epoch))
    assert counts == [3, 3, 3], "each bad file once an epoch, in the epoch that read it"


def test_with_bad_images_fail_the_first_one_stops_with_its_name(tmp_path, decoder):
    from multigpu.train.data.imagefolder import BadImageError

    _image_folder(tmp_path, bad=["train/b/0.png"])
    data = load_data(f"folder:{tmp_path}", input_kind="image", image_size=8, bad_images="fail")
    index = [p for p, _ in data.train.samples].index(str(tmp_path / "train/b/0.png"))
    with pytest.raises(BadImageError, match=r"cannot read image '.*train/b/0.png' .*--bad-images skip"):
        data.train[index]


@pytest.mark.parametrize("damage", ["truncated", "not an image"])
def test_a_damaged_jpeg_is_a_bad_image_for_either_decoder(tmp_path, decoder, damage, capsys):
    from PIL import Image

    _image_folder(tmp_path)
    photo = tmp_path / "train/a/1.jpg"
    scene = np.random.default_rng(0).integers(0, 255, size=(64, 64, 3), dtype=np.uint8)
    Image.fromarray(scene).save(photo, quality=90)
    data = photo.read_bytes()
    photo.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"<html>404</html>")
    dataset = load_data(f"folder:{tmp_path}", input_kind="image", image_size=8).train
    index = [p for p, _ in dataset.samples].index(str(photo))
    x, _ = dataset[index]
    assert x.shape == (3, 8, 8) and dataset.bad_count == 1
    assert "skipped unreadable image" in capsys.readouterr().err


@pytest.mark.skipif("torchvision" not in DECODERS_HERE, reason=(
    "torchvision does not import here: the dev extra leaves it out, since PyPI's Linux wheel is a "
    "CUDA build that does not load beside a CPU torch; tests/gpu/test_decode_gpu.py compares both "
    "decoders' crops on the GPU machines"))
def test_both_decoders_cut_the_same_validation_image(tmp_path):
    from PIL import Image

    ramp = np.add.outer(np.arange(90), np.arange(120)).astype(np.uint8)
    path = tmp_path / "ramp.png"
    Image.fromarray(np.stack([ramp, ramp[::-1], 255 - ramp], axis=2)).save(path)
    crops = [imagefolder.ImageFolderDataset([(str(path), 0)], ["a"], 32, False, decoder=d)[0][0].float()
             for d in ("pil", "torchvision")]
    assert crops[0].shape == crops[1].shape == (3, 32, 32)
    assert (crops[0] - crops[1]).abs().mean() < 2.0, "the same cut, up to the resampling's rounding"


def test_a_folder_of_one_class_is_refused(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        (tmp_path / split / "only").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / split / "only" / "x.png")
    with pytest.raises(UsageError, match="has one class folder \\(only\\): a classifier of one class"):
        load_data(f"folder:{tmp_path}", input_kind="image", image_size=8)


def test_adjacent_unreadable_images_are_each_counted_once_an_epoch(tmp_path, decoder):
    _image_folder(tmp_path, bad=["train/a/0.png", "train/a/1.png", "train/a/2.png"])  # 3 in a row
    data = load_data(f"folder:{tmp_path}", input_kind="image", image_size=8)
    for i in range(len(data.train)):  # one epoch
        data.train[i]
    assert data.train.bad_count == 3, "not 3 + 2 + 1: the walk past a bad file does not count it again"
