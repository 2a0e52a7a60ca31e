"""Generated data, in the layout each public script reads, for benchmarks/auto_public_scripts.py.

Nothing can be downloaded on the GPU machines, so each data set is made here, learnable: every
class has its own prototype (strokes for MNIST, coloured gratings for CIFAR and the ImageFolder),
each sample is its class's prototype, shifted, plus a fainter prototype of another class and
noise. Accuracy then means something (chance is 10 %, a model that learns gets well above it,
and the distractor and the noise keep it below 100 %, so seeds spread).

- MNIST: `<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`, the uncompressed IDX
  files torchvision's MNIST reads after its download step; MNIST(download=True) finds them and
  downloads nothing.
- CIFAR-10: `<root>/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}`, pickled dicts
  as the real archive holds them. torchvision checks their md5 against the real files' sums; the
  recorder (auto_public_record/sitecustomize.py) replaces that check, and says so.
- ImageFolder: `<root>/{train,val}/<class>/<n>.JPEG`, as pytorch/examples' ImageNet script reads.
- FashionMNIST: as MNIST, in `<root>/FashionMNIST/raw/` (torchvision's FashionMNIST is an MNIST).
- Text (the corpus' language models): sentences drawn from a small grammar, so that a model can
  learn it and a validation loss means something: `<path>` itself (karpathy/ng-video-lecture's
  input.txt), or nanoGPT's shakespeare_char layout, `<root>/{train,val}.bin` (uint16 character
  ids) and `<root>/meta.pkl` ({vocab_size, itos, stoi}), as its data/shakespeare_char/prepare.py
  writes them.
"""
from __future__ import annotations

import os
import pickle
import struct
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

CLASSES = 10


def _shift(img: np.ndarray, rng: np.random.Generator, most: int) -> np.ndarray:
    dy, dx = rng.integers(-most, most + 1, size=2)
    return np.roll(np.roll(img, dy, axis=0), dx, axis=1)


def _samples(protos: np.ndarray, n: int, seed: int | list[int], shift: int, mix: float,
             noise: float) -> tuple[np.ndarray, np.ndarray]:
    """n uint8 images (n, H, W[, C]) and their labels, balanced over the classes."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % len(protos)
    rng.shuffle(labels)
    out = np.empty((n,) + protos.shape[1:], dtype=np.uint8)
    for i, c in enumerate(labels):
        other = (c + rng.integers(1, len(protos))) % len(protos)
        img = _shift(protos[c], rng, shift) + mix * _shift(protos[other], rng, shift)
        img = img + rng.normal(0.0, noise, size=img.shape)
        out[i] = np.clip(img * 255.0, 0, 255).astype(np.uint8)
    return out, labels.astype(np.int64)


def _stroke_protos(size: int, seed: int) -> np.ndarray:
    """One grey-level prototype per class: three thick random strokes."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    protos = np.zeros((CLASSES, size, size), dtype=np.float32)
    for c in range(CLASSES):
        for _ in range(3):
            (y0, x0), (y1, x1) = rng.uniform(size * 0.2, size * 0.8, size=(2, 2))
            for t in np.linspace(0, 1, 12):
                cy, cx = y0 + t * (y1 - y0), x0 + t * (x1 - x0)
                protos[c] = np.maximum(protos[c], np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 3.0))
    return protos


def _grating_protos(size: int, seed: int) -> np.ndarray:
    """One colour prototype per class: an oriented grating of its own frequency and colours."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    protos = np.zeros((CLASSES, size, size, 3), dtype=np.float32)
    for c in range(CLASSES):
        angle, freq = rng.uniform(0, np.pi), rng.uniform(2, 6)
        wave = 0.5 + 0.5 * np.sin(2 * np.pi * freq * (xx * np.cos(angle) + yy * np.sin(angle)))
        colour_a, colour_b = rng.uniform(0.1, 0.9, size=(2, 3))
        protos[c] = wave[..., None] * colour_a + (1 - wave[..., None]) * colour_b
    return protos * 0.8


def write_mnist(root: Path, train: int, test: int, seed: int = 0, folder: str = "MNIST") -> None:
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    protos = _stroke_protos(28, seed)
    for prefix, n, s in (("train", train, seed + 1), ("t10k", test, seed + 2)):
        x, y = _samples(protos, n, s, shift=3, mix=0.6, noise=0.35)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28)
                                                         + x.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n)
                                                         + y.astype(np.uint8).tobytes())


def write_cifar(root: Path, train: int, test: int, seed: int = 0, mix: float = 0.7,
                noise: float = 0.3) -> None:
    """Five training batches and a test batch, as the real archive's pickles (HWC -> CHW rows)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    protos = _grating_protos(32, seed)
    x, y = _samples(protos, train, seed + 1, shift=4, mix=mix, noise=noise)
    parts = np.array_split(np.arange(train), 5)
    for i, part in enumerate(parts, 1):
        _pickle_batch(folder / f"data_batch_{i}", x[part], y[part])
    x, y = _samples(protos, test, seed + 2, shift=4, mix=mix, noise=noise)
    _pickle_batch(folder / "test_batch", x, y)
    names = [f"class{c}" for c in range(CLASSES)]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": names, "num_cases_per_batch": len(parts[0])}, f)


def _pickle_batch(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    rows = x.transpose(0, 3, 1, 2).reshape(len(x), -1)  # the archive stores CHW rows
    with open(path, "wb") as f:
        pickle.dump({"data": rows, "labels": [int(v) for v in y]}, f)


def _write_jpegs(job) -> None:
    """One chunk of an ImageFolder split: its samples drawn here, in a pool process, from a seed
    of its own, so that tens of thousands of images take seconds on a many-core machine."""
    from PIL import Image

    folder, start, n, seed, size = job
    protos = _grating_protos(size, seed[0])
    x, y = _samples(protos, n, seed, shift=size // 8, mix=0.7, noise=0.3)
    for i, (img, label) in enumerate(zip(x, y)):
        Image.fromarray(img).save(folder / f"class{label}" / f"{start + i:06d}.JPEG", quality=90)


def write_imagefolder(root: Path, train: int, val: int, size: int = 112, seed: int = 0) -> None:
    """JPEGs in class folders; drawn and written by a pool of processes, 256 to a chunk."""
    jobs, step = [], 256
    for split, n, s in (("train", train, seed + 1), ("val", val, seed + 2)):
        for c in range(CLASSES):
            (root / split / f"class{c}").mkdir(parents=True, exist_ok=True)
        jobs += [(root / split, i, min(step, n - i), [seed, s, i], size)
                 for i in range(0, n, step)]
    with ProcessPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        list(pool.map(_write_jpegs, jobs))


def write_fashion_mnist(root: Path, train: int, test: int, seed: int = 0) -> None:
    write_mnist(root, train, test, seed + 10, folder="FashionMNIST")


_WORDS = {"N": "king queen lord lady knight horse castle sword crown river".split(),
          "V": "sees loves fears serves follows finds keeps calls".split(),
          "A": "old young brave fair noble dark".split()}


def _text(chars: int, seed: int) -> str:
    """Sentences `The A N V the N.`, with speaker lines, about `chars` characters."""
    rng = np.random.default_rng(seed)
    pick = lambda k: _WORDS[k][rng.integers(len(_WORDS[k]))]  # noqa: E731
    out, size = [], 0
    while size < chars:
        line = f"{pick('N').upper()}:\nThe {pick('A')} {pick('N')} {pick('V')} the {pick('N')}.\n\n"
        out.append(line)
        size += len(line)
    return "".join(out)[:chars]


def write_text(path: Path, chars: int, _unused: int = 0, seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_text(chars, seed + 20))


def write_char_bins(root: Path, train: int, val: int, seed: int = 0) -> None:
    root.mkdir(parents=True, exist_ok=True)
    text = _text(train + val, seed + 30)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    ids[:train].tofile(root / "train.bin")
    ids[train:].tofile(root / "val.bin")
    with open(root / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)


# the corpus' layouts (benchmarks/auto_corpus.py): name -> writer(path, train, test)
LAYOUTS = {"mnist": write_mnist, "fashion-mnist": write_fashion_mnist, "cifar10": write_cifar,
           "text": write_text, "shakespeare-char": write_char_bins}
