"""JPEG decode + augmentation per CPU core: multigpu's PIL path against torchvision's.

    python benchmarks/image_transforms.py --out DIR [--images 300] [--rounds 5] [--size 224]

What one DataLoader worker (one thread) does per training and validation image of `folder:` data,
through multigpu.train.data.imagefolder.ImageFolderDataset as shipped, with each of its decoders:
- `pil`: PIL decode, one resize of the crop box, flip (the path without torchvision);
- `torchvision`: torchvision.io.decode_image into a uint8 tensor, then transforms.v2 on it;
- `tv-pil`: the alternative not taken, transforms.v2 on the PIL image, then PILToTensor.
The images are made here: smooth random scenes with grain, 500 x 375 (ImageNet's median shape),
saved as JPEG quality 90. Methods run in turns, round by round; the median round is reported.
One JSON object goes to DIR/image-transforms.json and is printed. Methods whose package does not
import are left out (torchvision: not beside torch 2.13's CPU wheel here; on the GPU image).
"""
import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from multigpu.train.data import imagefolder


def make_images(folder: Path, count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        coarse = rng.uniform(0, 255, size=(6, 8, 3)).astype(np.uint8)
        scene = np.asarray(Image.fromarray(coarse).resize((500, 375), Image.Resampling.BICUBIC), dtype=np.float32)
        scene += rng.normal(0, 12, size=scene.shape)
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(np.clip(scene, 0, 255).astype(np.uint8)).save(path, quality=90)
        paths.append(str(path))
    return paths


def methods(size: int) -> dict:
    """name -> make(train, paths) -> fn(index) -> uint8 (3, size, size)"""
    def shipped(decoder):
        def make(train, paths):
            dataset = imagefolder.ImageFolderDataset([(p, 0) for p in paths], ["a"], size, train, decoder=decoder)
            return lambda i: dataset[i][0]
        return make

    found = {"pil": shipped("pil")}
    if imagefolder.default_decoder() != "torchvision":
        return found
    from torchvision.transforms import v2

    def tv_pil(train, paths):  # the alternative not taken: v2 on PIL images
        crop = (v2.Compose([v2.RandomResizedCrop(size, scale=(0.35, 1.0), ratio=(3 / 4, 4 / 3)),
                            v2.RandomHorizontalFlip()]) if train
                else v2.Compose([v2.Resize(round(size * 8 / 7)), v2.CenterCrop(size)]))
        to_tensor = v2.PILToTensor()
        return lambda i: to_tensor(crop(imagefolder._decode(paths[i])))

    found.update({"torchvision": shipped("torchvision"), "tv-pil": tv_pil})
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--images", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=int, default=224)
    args = p.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)  # as in a DataLoader worker
    paths = make_images(out / "images", args.images)
    found = methods(args.size)
    rates: dict[str, list[float]] = {f"{m}/{split}": [] for m in found for split in ("train", "val")}
    for _ in range(args.rounds):
        for name, make in found.items():
            for split in ("train", "val"):
                fn = make(split == "train", paths)
                fn(0)  # warm
                began = time.perf_counter()
                for i in range(len(paths)):
                    sample = fn(i)
                rates[f"{name}/{split}"].append(len(paths) / (time.perf_counter() - began))
                assert sample.shape == (3, args.size, args.size) and sample.dtype == torch.uint8
    result = {
        "what": "images per second on one thread: JPEG 500x375 q90 decode + augmentation to uint8 CHW",
        "size": args.size, "images": args.images, "rounds": args.rounds,
        "torch": torch.__version__, "pillow": Image.__version__, "cpu": platform.processor() or platform.machine(),
        "median_images_per_second": {k: round(statistics.median(v), 1) for k, v in rates.items()},
        "rounds_images_per_second": {k: [round(x, 1) for x in v] for k, v in rates.items()},
    }
    try:
        import torchvision
        result["torchvision"] = torchvision.__version__
    except ImportError:
        pass
    (out / "image-transforms.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
