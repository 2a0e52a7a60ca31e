"""Generated JPEG folders in ImageFolder layout, of two kinds; no real dataset reaches the GPU machines.

    smooth    random colour fields with fine grain, all of one shape (`shape`): cheap to decode,
              small files; what `multigpu bench --data real` has always used
    detailed  1/f ("pink") noise, the power spectrum of natural photographs, so that a JPEG at
              quality 90 holds about as many bits as a photo does (~100 KB at 500 x 375, as
              ImageNet's average file); mixed shapes around ImageNet's (sides 300-800, most
              500 x 375 or 375 x 500, mean about 500 x 375), and, as in ImageNet, a few greyscale
              (1 in 33) and CMYK (1 in 50) files, which take other paths through decoders

Both are labelled as generated in the folder's manifest.json (written last: its presence means
the folder is complete). Image `seed` is the same file in every folder made with the same kind.
A large folder holds DISTINCT different training images; the others are hard links to them (image
i to image i % DISTINCT): every file is still opened, read and decoded as a distinct one is, though
its bytes come from the page cache once their first name was read (a real dataset's come from disk
until it is cached), and a large folder is made in seconds rather than minutes.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
import shutil
from pathlib import Path

KINDS = ("smooth", "detailed")
QUALITY = 90
GREY_EVERY, CMYK_EVERY = 33, 50  # image seeds i with i % N == 0 (grey) or 1 (CMYK): detailed
# (long side, short side) and their weights, for detailed images: ImageNet's files are mostly
# 500 x 375 / 500 x 333, with a spread of smaller and larger ones.
SHAPES = ((500, 375), (500, 333), (500, 500), (400, 300), (640, 480), (800, 600), (300, 225), (800, 533))
SHAPE_WEIGHTS = (0.42, 0.20, 0.06, 0.10, 0.08, 0.03, 0.07, 0.04)
LANDSCAPE = 0.75
DISTINCT = 8192  # different training images in a folder; the rest link to them


def detailed_shape(seed: int) -> tuple[int, int]:
    """(width, height) of detailed image `seed`."""
    import numpy as np

    rng = np.random.default_rng([seed, 1])
    long, short = SHAPES[rng.choice(len(SHAPES), p=SHAPE_WEIGHTS)]
    return (long, short) if rng.random() < LANDSCAPE else (short, long)


def detailed_mode(seed: int) -> str:
    """The PIL mode detailed image `seed` is saved in: mostly RGB, a few L and CMYK."""
    return "L" if seed % GREY_EVERY == 0 else "CMYK" if seed % CMYK_EVERY == 1 else "RGB"


def make_image(kind: str, seed: int, shape: tuple[int, int] = (500, 375)):
    """The PIL image `seed` of `kind`; `shape` (width, height) is the smooth kind's."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    if kind == "smooth":
        width, height = shape
        coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
        smooth = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
        noisy = smooth + rng.integers(-12, 13, (height, width, 3), dtype=np.int16)
        return Image.fromarray(noisy.clip(0, 255).astype(np.uint8))
    if kind != "detailed":
        raise ValueError(f"image kind {kind!r}: choose one of {', '.join(KINDS)}")
    width, height = detailed_shape(seed)
    pixels = _pink_noise(rng, width, height)
    return Image.fromarray(pixels).convert(detailed_mode(seed))


def _pink_noise(rng, width: int, height: int, alpha: float = 1.15):
    """uint8 (height, width, 3): 1/f^alpha noise, the channels correlated as a photo's are."""
    import numpy as np

    fy, fx = np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :]
    radius = np.sqrt(fx ** 2 + fy ** 2)
    radius[0, 0] = 1.0
    amplitude = radius ** -alpha
    bins = (height, width // 2 + 1)

    def spectrum():
        return rng.normal(size=bins) + 1j * rng.normal(size=bins)

    shared = spectrum()
    channels = [np.fft.irfft2((shared + 0.6 * spectrum()) * amplitude, s=(height, width)) for _ in range(3)]
    field = np.stack(channels, -1)
    field = (field - field.mean()) / field.std()
    grain = rng.normal(0, 3, field.shape)
    return np.clip(128 + 48 * field + grain, 0, 255).astype(np.uint8)


def write_image(job: tuple[str, str, int, tuple[int, int]]) -> None:
    """One file: job = (path, kind, seed, smooth shape)."""
    path, kind, seed, shape = job
    make_image(kind, seed, shape).save(path, "JPEG", quality=QUALITY)


def write_folder(root: str | Path, kind: str, train: int, val: int, classes: int = 10,
                 shape: tuple[int, int] = (500, 375), workers: int | None = None) -> Path:
    """`train` + `val` images of `kind` under root/train/class_NN/ and root/val/class_NN/ (image i
    in class i % classes), then root/manifest.json. Training images are seeds 0..train-1 (past
    DISTINCT, links: see above), the validation ones the next `val`."""
    if kind not in KINDS:
        raise ValueError(f"image kind {kind!r}: choose one of {', '.join(KINDS)}")
    root = Path(root)
    paths = {}
    for split, first, count in (("train", 0, train), ("val", train, val)):
        for c in range(classes):
            (root / split / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
        for i in range(count):
            paths[split, i] = str(root / split / f"class_{i % classes:02d}" / f"{first + i:07d}.jpg")
    jobs = [(path, kind, i + (train if split == "val" else 0), tuple(shape))
            for (split, i), path in paths.items() if split == "val" or i < DISTINCT]
    workers = workers or max(1, os.cpu_count() or 1)
    if workers == 1 or len(jobs) < 256:
        for job in jobs:
            write_image(job)
    else:
        with ProcessPoolExecutor(workers) as pool:
            list(pool.map(write_image, jobs, chunksize=16))
    for i in range(DISTINCT, train):
        _link(paths["train", i % DISTINCT], paths["train", i])
    manifest = {"generated": "by multigpu.bench.imagegen, not photographs", "kind": kind,
                "train_images": train, "distinct_train_images": min(train, DISTINCT), "val_images": val,
                "classes": classes,
                "format": f"jpeg q{QUALITY}",
                "shape": list(shape) if kind == "smooth" else "mixed, mean about 500x375"}
    (root / "manifest.json").write_text(json.dumps(manifest) + "\n")
    return root


def _link(source: str, target: str) -> None:
    if os.path.lexists(target):  # a folder written again: its image is made anew, as the others
        os.unlink(target)
    try:
        os.link(source, target)
    except OSError:  # a file system without hard links
        shutil.copyfile(source, target)
