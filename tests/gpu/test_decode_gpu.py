"""GPU tier for folder: data decoded on the GPU (gpu_images, jpeg_decoders): nvImageCodec and
torchvision's nvJPEG against the CPU path, and `multigpu train --decode` end to end, resumed
inside an epoch.

Run on a machine with a GPU and torchvision:  pytest -m gpu tests/gpu/test_decode_gpu.py
The nvImageCodec tests skip unless its wheels are importable, e.g.
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site:$PWD/src pytest -m gpu tests/gpu/test_decode_gpu.py
"""
import importlib.util
import io
import re

import pytest
import torch

from multigpu.train.data import gpu_images, imagefolder, jpeg_decoders
from tests.multiproc.conftest import multigpu as run_multigpu
from tests.multiproc.conftest import read_metrics
from tests.unit.test_gpu_images import make_folder, samples, scene
from tests.unit.test_jpeg_decoders import meeting_inside

GPU = torch.device("cuda", 0)
pytestmark = [pytest.mark.gpu, pytest.mark.cuda_here,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.fixture(autouse=True)
def _a_gpu_decoder():
    """Probed when a test of this file runs, not when it is collected: the probe starts CUDA in
    this process (conftest runs these tests last)."""
    problem = gpu_images.gpu_decode_problem(GPU)
    if problem is not None:
        pytest.skip(f"no GPU JPEG decoder here: {problem}")


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
    # nvImageCodec where installed (an H100 has the engines), torchvision's nvJPEG otherwise
    picked = "nvImageCodec, hardware JPEG engines" if HAS_NVIMGCODEC else "torchvision's nvJPEG"
    assert re.search(rf"folder: JPEGs decoded on cuda:0 \({re.escape(picked)}\)", whole.stdout), whole.stdout
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


HAS_NVIMGCODEC = importlib.util.find_spec("nvidia") is not None and \
    importlib.util.find_spec("nvidia.nvimgcodec") is not None
needs_nvimgcodec = pytest.mark.skipif(not HAS_NVIMGCODEC, reason="nvidia-nvimgcodec-cu13 is not installed")


def jpeg(picture, **save):
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", **{"quality": 90, **save})
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decoded_on_a_side_stream(decoder, files):
    """As the prefetch thread calls it: on a stream of its own, then used there."""
    side = torch.cuda.Stream(GPU)
    with torch.cuda.device(GPU), torch.cuda.stream(side):
        images = decoder.decode(files, GPU)
        cpu = [None if x is None else x.to("cpu", non_blocking=False) for x in images]
    torch.cuda.synchronize(GPU)
    return images, cpu


@needs_nvimgcodec
def test_nvimagecodec_picks_the_engines_and_decodes_as_pil_does():
    """As the CPU path's PIL, within a level and a half on average (torchvision's nvJPEG is
    printed beside it: it upsamples 4:2:2 chroma otherwise, 4.2 levels from PIL on an H100)."""
    chosen = jpeg_decoders.choose(GPU)
    assert isinstance(chosen, jpeg_decoders.NvImageCodecDecoder), chosen
    assert chosen.name == "nvImageCodec, hardware JPEG engines"
    files = [jpeg(scene(500, 375, seed=1)), jpeg(scene(500, 375, seed=2).convert("L")),
             jpeg(scene(333, 500, seed=3), subsampling=0), jpeg(scene(64, 48, seed=4), subsampling=1),
             jpeg(scene(1024, 683, seed=5), quality=75), jpeg(scene(31, 17, seed=6))]
    images, ours = decoded_on_a_side_stream(chosen, files)
    theirs = decoded_on_a_side_stream(jpeg_decoders.TorchvisionDecoder(), files)[1]
    for k, data in enumerate(files):
        pil = jpeg_decoders.pil_decode(data).float()
        assert images[k].device == GPU and images[k].dtype == torch.uint8 and ours[k].shape == pil.shape, k
        to_pil = (ours[k].float() - pil).abs().mean().item()
        to_torchvision = (ours[k].float() - theirs[k].float()).abs().mean().item()
        print(f"file {k} {tuple(pil.shape)}: mean abs difference to PIL {to_pil:.3f}, to torchvision "
              f"{to_torchvision:.3f}")
        assert to_pil < 1.5, k


@needs_nvimgcodec
def test_two_finishing_threads_decode_at_once_and_give_one_threads_pixels(tmp_path):
    """The folder's encoded batches through prefetch_thread (moved first, as the prepared loader
    moves them) with the decoder's two helpers, each on its stream with a Decoder of its own:
    every call meets the other inside the decode (a barrier: helpers taking turns would break
    it). Every batch handed over is kept on the GPU until the end, then compared with the same
    batches finished one at a time: a buffer reused while the training stream still read it would
    show as changed pixels."""
    import threading

    from multigpu.core.loading.data import move_to_device
    from multigpu.core.loading.prefetch_thread import finish_in_thread

    chosen = jpeg_decoders.choose(GPU)
    assert isinstance(chosen, jpeg_decoders.NvImageCodecDecoder) and chosen.threads == chosen.pool_size == 2
    train = imagefolder.load_folder(str(make_folder(tmp_path, per_class=16)), 64).train
    encoded = samples(train, on_gpu=True)
    batches = [gpu_images.collate(encoded[k:k + 4]) for k in range(0, len(encoded) - 3, 4)]
    assert len(batches) % 2 == 0

    def finished(threads):
        source = ((k, (x, y)) for k, (x, y) in enumerate(batches))
        kept = list(finish_in_thread(source, GPU, lambda b: train.on_device(move_to_device(b, GPU, True), GPU),
                                     threads=threads))
        torch.cuda.synchronize(GPU)
        return [(k, x.cpu(), y.cpu()) for k, (x, y) in kept]

    one = finished(1)
    held = chosen._decoder
    chosen._decoder = meeting_inside(chosen, threading.Barrier(2, timeout=30))
    try:
        two = finished(2)
    finally:
        chosen._decoder = held
    assert [k for k, _, _ in two] == list(range(len(batches)))
    for (_, x1, y1), (_, x2, y2) in zip(one, two, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


@needs_nvimgcodec
@pytest.mark.parametrize("transient", [True, False])
def test_batches_read_behind_a_busy_stream_come_out_as_pil_decodes_them(transient):
    """The crops' call (decode_transient, into the last batch's Images) and the plain one (new
    Images, stream-ordered memory) on one side stream, batch after batch of larger and smaller
    files and other counts, each read on that stream behind a kernel that keeps it busy (so that a
    write not queued behind the reads would land first): every batch as a fresh decode gives it,
    within PIL's level and a half; with decode_transient a batch of smaller files is decoded into
    the memory of the one before."""
    chosen = jpeg_decoders.choose(GPU)
    assert isinstance(chosen, jpeg_decoders.NvImageCodecDecoder), chosen
    widths, counts = (400, 250, 330, 200, 300), (4, 4, 2, 6, 3)
    batches = [[jpeg(scene(widths[step] + 37 * k, 150 + 20 * (step % 2), seed=10 * step + k)) for k in range(count)]
               for step, count in enumerate(counts)]
    fresh = [decoded_on_a_side_stream(chosen, files)[1] for files in batches]
    side = torch.cuda.Stream(GPU)
    call = chosen.decode_transient if transient else chosen.decode
    with torch.cuda.device(GPU), torch.cuda.stream(side):
        read, where = [], []
        for files in batches:
            images = call(files, GPU)
            where.append({image.data_ptr() for image in images})
            torch.cuda._sleep(50_000_000)  # tens of milliseconds of a busy side stream
            read.append([image.to("cpu", non_blocking=True) for image in images])  # queued behind it
            del images
    torch.cuda.synchronize(GPU)
    if transient:
        assert where[1] <= where[0], "the smaller files of batch 1 went into batch 0's memory"
    for step, (files, got, want) in enumerate(zip(batches, read, fresh, strict=True)):
        for k, data in enumerate(files):
            assert torch.equal(got[k], want[k]), (step, k)
            assert (got[k].float() - jpeg_decoders.pil_decode(data).float()).abs().mean() < 1.5, (step, k)


@needs_nvimgcodec
def test_files_the_engines_refuse_come_out_as_pil_decodes_them():
    """Progressive and CMYK JPEGs: gpu_readable leaves them to the loader workers; sent to the
    device anyway, the engines refuse them (nvImageCodec's CUDA decoder did not start on an
    H100) and the GPU path decodes them with PIL, never into a wrong image."""
    picture = scene(200, 150, seed=7)
    files = [jpeg(picture, progressive=True), jpeg(picture.convert("CMYK"))]
    assert [gpu_images.gpu_readable(memoryview(f.numpy())) for f in files] == [None, None]
    batch = gpu_images.ImageBatch([gpu_images.EncodedImage(f, (0, 0, 200, 150), False, k, 0)
                                   for k, f in enumerate(files)])
    with torch.cuda.device(GPU):
        images = gpu_images._decode(batch, GPU, lambda k, exc: pytest.fail(f"file {k}: {exc}"))
    for k, data in enumerate(files):
        assert images[k].device == GPU, k
        assert torch.equal(images[k].cpu(), jpeg_decoders.pil_decode(data)), k


@needs_nvimgcodec
def test_nvimagecodec_batch_with_a_truncated_file_replaces_and_counts_it(tmp_path, capsys):
    def no_scan(path):  # a header and an end marker, no image data: sent encoded, unreadable
        whole = (tmp_path / "imgs/val/a/0.jpg").read_bytes()
        path.write_bytes(whole[:whole.index(b"\xff\xda")] + b"\xff\xda\x00\x02" + b"\xff\xd9")

    def cut_in_half(path):  # libjpeg (PIL) reads the first half, grey below: not a bad file
        whole = (tmp_path / "imgs/val/a/1.jpg").read_bytes()
        path.write_bytes(whole[: len(whole) // 2] + b"\xff\xd9")

    data = make_folder(tmp_path / "imgs", extra={"train/a/zz.jpg": no_scan, "train/a/zy.jpg": cut_in_half})
    train = imagefolder.load_folder(str(data), 32, decoder="pil").train
    assert isinstance(jpeg_decoders.choose(GPU), jpeg_decoders.NvImageCodecDecoder)
    paths = [p for p, _ in train.samples]
    bad, half = paths.index(str(data / "train/a/zz.jpg")), paths.index(str(data / "train/a/zy.jpg"))
    encoded = samples(train, on_gpu=True)
    assert isinstance(encoded[bad][0], gpu_images.EncodedImage)
    assert isinstance(encoded[half][0], gpu_images.EncodedImage)
    capsys.readouterr()
    with torch.cuda.stream(torch.cuda.Stream(GPU)):
        x, y = train.on_device(gpu_images.collate(encoded), GPU)
    torch.cuda.synchronize(GPU)
    err = capsys.readouterr().err
    assert x.shape == (len(train), 3, 32, 32)
    assert train.bad_count == 1 and err.count("skipped unreadable image") == 1, err
    assert "zz.jpg" in err and y[bad] == train.samples[bad + 1][1]


def test_auto_times_each_way_on_the_gpu_and_keeps_one_for_the_run(tmp_path):
    """--decode auto on one GPU: the trial's line, decode.json and the checkpoint agree, and the
    epoch that held the trial still trains on every sample once. 4 workers of batch 1, and the
    finishing helpers' batches ahead: the epoch is sized from the trial's own plan (its lag and
    windows), with 8 steps to spare."""
    import json

    from multigpu.core.loading.prefetch_thread import batches_ahead
    from multigpu.train.data.decode_choice import Plan, candidate_shares

    helpers = jpeg_decoders.NvImageCodecDecoder.threads
    plan = Plan.for_loader(candidate_shares(4), 4, 4, batches_ahead(helpers))
    per_class = (plan.total + 8 + 1) // 2
    root = tmp_path / "imgs"
    for split, count in (("train", per_class), ("val", 4)):
        for c in range(2):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                scene(500, 375, seed=(10 * c + i) % 12).save(folder / f"{i}.jpg", quality=90)
    out = tmp_path / "run"
    proc = run_multigpu("train", "--model", "resnet18", "--data", f"folder:{root}", "--image-size", "64",
                        "--devices", "0,", "--min-free-memory", "0", "--batch-size", "1", "--workers", "4",
                        "--decode", "auto",
                        "--epochs", "1", "--out", out, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = re.search(rf"decode: samples/s over 6 windows of {plan.steps} steps in epoch 1: cpu [\d,]+, gpu [\d,]+, "
                     r"hybrid \d+% [\d,]+; (cpu|gpu|hybrid \d+%) kept for the run", proc.stdout)
    assert said, proc.stdout[-3000:]
    chosen = json.loads((out / "decode.json").read_text())
    assert chosen["measured"] is True and said.group(1) in chosen["rates"]
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["decode"] == chosen
    assert read_metrics(out)[0]["train_samples"] == 2 * per_class
