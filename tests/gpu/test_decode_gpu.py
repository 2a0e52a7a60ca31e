"""GPU tier for folder: data decoded on the GPU (gpu_images): nvJPEG against the CPU path, and
`multigpu train --decode` end to end, resumed inside an epoch.

Run on a machine with a GPU and torchvision:  pytest -m gpu tests/gpu/test_decode_gpu.py
"""
import re

import pytest
import torch

from multigpu.train import gpu_images, imagefolder
from tests.multiproc.conftest import multigpu as run_multigpu
from tests.multiproc.conftest import read_metrics
from tests.unit.test_gpu_images import make_folder, samples, scene

GPU = torch.device("cuda", 0)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and gpu_images.gpu_decode_problem(GPU) is not None,
                                 reason="torchvision's nvJPEG does not work here")]


def imagenet_like(root, per_class=6):
    """500 x 375 JPEGs (ImageNet's median shape), a PNG among them."""
    for split in ("train", "val"):
        for c in range(2):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                scene(500, 375, seed=10 * c + i).save(folder / f"{i}.jpg", quality=90)
    scene(300, 200, seed=99).save(root / "train" / "c0" / "z.png")
    return root


@pytest.mark.parametrize("decoder", ["pil", "torchvision"])
@pytest.mark.parametrize("split", ["train", "val"])
def test_nvjpeg_gives_the_cpu_paths_crops(tmp_path, split, decoder):
    """Either CPU decoder draws the same box and flip as the GPU path (ImageFolderDataset._crop)."""
    dataset = getattr(imagefolder.load_folder(str(imagenet_like(tmp_path)), 224, decoder=decoder), split)
    cpu = torch.stack([x for x, _ in samples(dataset, on_gpu=False)])
    batch = gpu_images.collate(samples(dataset, on_gpu=True))
    with torch.cuda.stream(torch.cuda.Stream(GPU)):  # as the prepared loader calls it
        x, y = dataset.on_device(batch, GPU)
    torch.cuda.synchronize(GPU)
    assert x.device == GPU and x.dtype == torch.uint8 and x.shape == cpu.shape
    diff = (x.cpu().float() - cpu.float()).abs()
    # nvJPEG's IDCT and upsampling differ from libjpeg-turbo's by a level or two; the same
    # boxes and flips keep the mean far below what a pixel's shift gives.
    print(f"{split}, {decoder}: mean abs difference {diff.mean():.3f}, max {diff.max():.0f}")
    assert diff.mean() < 1.5


def test_train_decodes_on_the_gpu_and_a_run_resumed_inside_an_epoch_ends_the_same(tmp_path):
    data = make_folder(tmp_path / "imgs", per_class=24)  # 48 training images: 6 steps of 8
    common = ["--model", "resnet18", "--data", f"folder:{data}", "--image-size", "64", "--batch-size", "8",
              "--workers", "2", "--deterministic", "--devices", "0,", "--min-free-memory", "0",
              "--logger", "none", "--epochs", "2"]  # GPU 0 though this process holds it

    def train(out, *extra):
        proc = run_multigpu("train", *common, "--out", tmp_path / out, *extra, timeout=400)
        assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
        return proc

    whole = train("whole", "--checkpoint-every", "2", "--keep", "10")
    assert re.search(r"folder: JPEGs decoded on cuda:0 \(nvJPEG\)", whole.stdout)
    middle = tmp_path / "whole" / "checkpoints" / "step-000000004.pt"  # 4 of epoch 1's 6 steps
    train("resumed", "--resume", middle, "--workers", "3")
    final = [torch.load(tmp_path / run / "checkpoints" / "last.pt", weights_only=True)["model"]
             for run in ("whole", "resumed")]
    assert final[0].keys() == final[1].keys()
    for name in final[0]:
        assert torch.equal(final[0][name], final[1][name]), name

    on_cpu = train("cpu", "--decode", "cpu")
    assert "folder: images decoded by 2 loader workers per GPU (--decode cpu)" in on_cpu.stdout
    # (torchvision's CPU transforms draw other crops than gpu_images: no loss to compare with)
    assert [r["train_samples"] for r in read_metrics(tmp_path / "cpu")] == [48, 48]


def test_auto_times_each_way_on_the_gpu_and_keeps_one_for_the_run(tmp_path):
    """--decode auto on one GPU: the trial's line, decode.json and the checkpoint agree, and the
    epoch that held the trial still trains on every sample once. 4 workers: lag 4 x 4 + 1 + 3 =
    20 steps, windows of 20, so the trial takes 10 + 6 x 40 = 250 steps of batch 1."""
    import json

    root = tmp_path / "imgs"
    for split, per_class in (("train", 130), ("val", 4)):
        for c in range(2):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                scene(500, 375, seed=(10 * c + i) % 12).save(folder / f"{i}.jpg", quality=90)
    out = tmp_path / "run"
    proc = run_multigpu("train", "--model", "resnet18", "--data", f"folder:{root}", "--image-size", "64",
                        "--devices", "0,", "--min-free-memory", "0", "--batch-size", "1", "--workers", "4",
                        "--decode", "auto",
                        "--epochs", "1", "--out", out, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = re.search(r"decode: samples/s over 6 windows of 20 steps in epoch 1: cpu [\d,]+, gpu [\d,]+, "
                     r"hybrid \d+% [\d,]+; (cpu|gpu|hybrid \d+%) kept for the run", proc.stdout)
    assert said, proc.stdout[-3000:]
    chosen = json.loads((out / "decode.json").read_text())
    assert chosen["measured"] is True and said.group(1) in chosen["rates"]
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["decode"] == chosen
    assert read_metrics(out)[0]["train_samples"] == 260
