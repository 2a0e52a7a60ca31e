"""folder: images decoded on the device (gpu_images): the same crops and flips as the CPU path,
the files the device path leaves to the workers, bad files, and the prepared loader around it.
Here the device is the CPU and PIL stands in for nvJPEG (tests/gpu/test_decode_gpu.py runs nvJPEG)."""
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from multigpu.train.data import gpu_images, imagefolder
from multigpu.train.data.datasets import load_data
from multigpu.core.errors import UsageError
from multigpu.core.loading.loaders import PerSampleSeed, shard_loader

CPU = torch.device("cpu")


def scene(width, height, seed):
    """A smooth random picture (JPEG-friendly: few artefacts), as a PIL image."""
    coarse = np.random.default_rng(seed).uniform(0, 255, size=(6, 8, 3)).astype(np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)


def make_folder(root, per_class=5, extra=None):
    for split in ("train", "val"):
        for c, name in enumerate(("a", "b")):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                scene(90 + 13 * i, 70 + 5 * c, seed=100 * c + i).save(folder / f"{i}.jpg", quality=92)
    for rel, write in (extra or {}).items():
        write(root / rel)
    return root


def folder_data(root, size=32):
    """The PIL decoder on the CPU path (the one the GPU path's crops are compared with)."""
    return imagefolder.load_folder(str(root), size, decoder="pil")


def samples(dataset, on_gpu, seed=3, epoch=0):
    """Every sample as a seeded loader worker makes it (loaders.PerSampleSeed)."""
    dataset.on_gpu = on_gpu
    seeded = PerSampleSeed(dataset, seed)
    return [seeded[(epoch, i)] for i in range(len(dataset))]


@pytest.mark.parametrize("split", ["train", "val"])
def test_the_device_path_makes_the_cpu_paths_crops_and_flips(tmp_path, split):
    dataset = getattr(folder_data(make_folder(tmp_path)), split)
    cpu = torch.stack([x for x, _ in samples(dataset, on_gpu=False)])
    encoded = samples(dataset, on_gpu=True)
    assert all(isinstance(x, gpu_images.EncodedImage) for x, _ in encoded)
    x, y = dataset.on_device(gpu_images.collate(encoded), CPU)
    assert x.shape == cpu.shape and x.dtype == torch.uint8
    assert y.tolist() == [0] * 5 + [1] * 5
    # Same boxes and flips, and PIL's weights as matrices (crop_resize): only rounding differs.
    # A box or flip off by a pixel gives several levels on average.
    diff = (x.float() - cpu.float()).abs()
    assert diff.mean() < 0.25 and diff.max() <= 2
    if split == "train":
        flipped = [bool(s.flip) for s, _ in encoded]
        assert any(flipped) and not all(flipped)


def test_a_batch_mixes_what_the_workers_decoded_in_place(tmp_path):
    def png(path):
        scene(60, 50, 7).save(path.with_suffix(".png"))

    def progressive(path):
        scene(80, 60, 8).save(path, quality=90, progressive=True)

    def cmyk(path):
        scene(80, 60, 9).convert("CMYK").save(path, quality=90)

    extra = {"train/a/x_png": png, "train/a/x_prog.jpg": progressive, "train/b/x_cmyk.jpg": cmyk}
    train = folder_data(make_folder(tmp_path, extra=extra)).train
    paths = [p for p, _ in train.samples]
    left_to_cpu = {paths.index(str(tmp_path / r)) for r in ("train/a/x_png.png", "train/a/x_prog.jpg",
                                                              "train/b/x_cmyk.jpg")}
    cpu = torch.stack([x for x, _ in samples(train, on_gpu=False)])
    encoded = samples(train, on_gpu=True)
    assert {i for i, (x, _) in enumerate(encoded) if isinstance(x, torch.Tensor)} == left_to_cpu
    batch = gpu_images.collate(encoded)
    assert batch[0].decoded_at == sorted(left_to_cpu)
    x, _ = train.on_device(batch, CPU)
    for i in left_to_cpu:  # the worker's own pixels, at their place in the batch
        assert torch.equal(x[i], cpu[i])
    assert (x.float() - cpu.float()).abs().mean() < 0.5


def test_only_whole_jpegs_are_sent_encoded(tmp_path):
    scene(80, 60, 9).save(tmp_path / "a.jpg", quality=90)
    whole = (tmp_path / "a.jpg").read_bytes()
    assert gpu_images.gpu_readable(whole) == (80, 60)
    assert gpu_images.gpu_readable(whole[:-2]) is None, "no end marker: truncated"
    assert gpu_images.gpu_readable(b"\x89PNG" + whole[4:]) is None
    assert gpu_images.gpu_readable(b"\xff\xd8 not a jpeg \xff\xd9") is None


def test_the_hybrid_leaves_its_share_to_the_workers(tmp_path):
    train = folder_data(make_folder(tmp_path, per_class=20)).train
    train.cpu_share = 0.25
    on_cpu = sum(isinstance(x, torch.Tensor) for x, _ in samples(train, on_gpu=True))
    assert on_cpu == 10  # a quarter of 40, spread evenly over the indices


def test_a_file_neither_decoder_reads_is_replaced_by_the_next_and_counted(tmp_path, capsys):
    def broken_body(path):  # a header PIL accepts and an end marker, but no image data
        whole = (tmp_path / "val/a/0.jpg").read_bytes()
        path.write_bytes(whole[:whole.index(b"\xff\xda")] + b"\xff\xda\x00\x02" + b"\xff\xd9")

    train = folder_data(make_folder(tmp_path, extra={"train/a/zz.jpg": broken_body})).train
    index = [p for p, _ in train.samples].index(str(tmp_path / "train/a/zz.jpg"))
    encoded = samples(train, on_gpu=True)
    assert isinstance(encoded[index][0], gpu_images.EncodedImage), "it passes the header checks"
    torch.manual_seed(1)
    x, y = train.on_device(gpu_images.collate(encoded), CPU)
    assert train.bad_count == 1
    assert x.shape == (len(train), 3, 32, 32)
    assert train.samples[index + 1][1] == 1 and y[index] == 1, "the next file's label, class b's"
    nxt = train._item(index + 1, on_gpu=False)[0]  # a crop of the next file: compare its colours
    assert (x[index].float().mean((1, 2)) - nxt.float().mean((1, 2))).abs().max() < 25
    assert capsys.readouterr().err.count("skipped unreadable image") == 1
    torch.manual_seed(2)  # the replacement's crop comes from the sample's seed, not torch's RNG
    state = torch.get_rng_state()
    again, _ = train.on_device(gpu_images.collate(encoded), CPU)
    assert torch.equal(again, x) and torch.equal(torch.get_rng_state(), state)

    train.bad_images = "fail"
    with pytest.raises(imagefolder.BadImageError, match=r"cannot read image '.*zz.jpg'"):
        train.on_device(gpu_images.collate(encoded), CPU)


def test_the_prepared_loader_decodes_on_the_device_and_resumes_exactly(tmp_path):
    train = folder_data(make_folder(tmp_path, per_class=9)).train

    def run(on_gpu, start=0, workers=2):
        train.on_gpu = on_gpu
        loader = DataLoader(train, batch_size=4, shuffle=True, num_workers=workers, collate_fn=train.collate)
        prepared = shard_loader(loader, layout=(1, 0, 1), device=CPU, seed=11,
                                on_step=lambda info: None)
        prepared.set_epoch(1, start)
        return [batch for batch in prepared]

    on_device, on_cpu = run(True), run(False)
    assert [len(y) for _, y in on_device] == [4, 4, 4, 4, 2]
    for (x, y), (cx, cy) in zip(on_device, on_cpu, strict=True):
        assert x.dtype == torch.uint8 and torch.equal(y, cy)
        assert (x.float() - cx.float()).abs().mean() < 0.5
    resumed = run(True, start=8, workers=1)  # another worker count, from inside the epoch
    for (x, y), (ex, ey) in zip(resumed, on_device[2:], strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_decode_choice_on_a_cpu_run(tmp_path):
    data = folder_data(make_folder(tmp_path))
    assert imagefolder.use_decode(data, "auto", CPU, workers=2) is None
    assert data.train.on_gpu is False and data.val.on_gpu is False
    with pytest.raises(UsageError) as excinfo:
        imagefolder.use_decode(data, "gpu", CPU, workers=2)
    assert str(excinfo.value) == ("--decode gpu: the run's device is cpu, not a GPU; use --decode cpu "
                                  "(the loader workers decode) or auto")
    assert imagefolder.use_decode(load_data("digits", input_kind="image", image_size=None), "gpu", CPU, 2) is None


def test_center_box_is_the_resize_then_centre_crop():
    # 500 x 375 to 224: shorter side to 256 (scale 0.6827), centre 224 = 328 source pixels
    assert gpu_images.center_box(500, 375, 224) == (86, 23, 328, 328)
    assert gpu_images.center_box(10, 10, 224) == (0, 0, 9, 9)  # 224/256 of 10


def test_auto_times_the_ways_in_the_job_and_deterministic_keeps_the_rule(tmp_path, monkeypatch):
    def no_probe(device):
        raise AssertionError("nvJPEG started on the GPU for a run whose workers decode alone")
    monkeypatch.setattr(gpu_images, "gpu_decode_problem", no_probe)
    data, gpu = folder_data(make_folder(tmp_path)), torch.device("cuda", 0)
    assert imagefolder.use_decode(data, "auto", gpu, 15, deterministic=True) == (
        "folder: images decoded by 15 loader workers per GPU (enough of them: --decode gpu to decode on the GPU)")
    assert not data.train.on_gpu and not data.val.on_gpu and not data.train.measure_decode
    monkeypatch.setattr(gpu_images, "gpu_decode_problem", lambda device: None)  # a GPU with nvJPEG
    monkeypatch.setattr(gpu_images, "decoder_name", lambda device: "torchvision's nvJPEG")
    imagefolder.use_decode(data, "auto", gpu, 3, deterministic=True)  # the same decoder after any resume
    assert (data.train.on_gpu, data.train.cpu_share, data.train.measure_decode) == (True, 0.0, False)
    # doctor and bench build the job without the trial: the rule, said as what happens
    assert imagefolder.use_decode(data, "auto", gpu, 3) == (
        "folder: JPEGs decoded on cuda:0 (torchvision's nvJPEG), the crops there too; 3 loader workers "
        "read the files (--decode cpu: the workers decode)")
    assert (data.train.on_gpu, data.train.cpu_share, data.train.measure_decode) == (True, 0.0, False)
    assert imagefolder.use_decode(data, "auto", gpu, 3, trial=True) == (
        "folder: --decode auto: 3 loader workers, cuda:0 (torchvision's nvJPEG) and both are timed in "
        "turns in the first epoch; the fastest is kept for the run")
    # until the trial (decode_choice), the rule's way: a hybrid with 3 workers, them alone with 15
    assert (data.train.on_gpu, data.train.cpu_share, data.val.cpu_share) == (True, 0.17, 0.17)
    assert data.train.measure_decode
    imagefolder.use_decode(data, "auto", gpu, 15, trial=True)
    assert (data.train.on_gpu, data.train.cpu_share, data.train.measure_decode) == (True, 1.0, True)
    assert imagefolder.use_decode(data, "gpu", gpu, 15).startswith(
        "folder: JPEGs decoded on cuda:0 (torchvision's nvJPEG), the crops")
    assert (data.train.on_gpu, data.train.cpu_share, data.train.measure_decode) == (True, 0.0, False)


def test_crop_resize_in_chunks_upscaling_and_flipped_is_pils(monkeypatch):
    from PIL import Image as PILImage

    from multigpu.train.data import crop_resize

    pictures = [scene(400, 300, 1), scene(60, 40, 2), scene(123, 77, 3)]
    boxes = [(10, 20, 300, 250), (5, 3, 20, 30), (0, 0, 123, 77)]  # shrink, enlarge, whole
    flips = [False, True, False]
    tensors = [torch.from_numpy(np.array(p)).permute(2, 0, 1).contiguous() for p in pictures]
    whole = crop_resize.crop_resize(tensors, boxes, flips, 32)
    monkeypatch.setattr(crop_resize, "CHUNK_BYTES", 400 * 300 * 6)  # the big one alone
    assert crop_resize._chunks([400 * 300, 60 * 40, 123 * 77]) == [[0], [2, 1]]
    assert torch.equal(crop_resize.crop_resize(tensors, boxes, flips, 32), whole)
    for picture, (left, top, w, h), flip, ours in zip(pictures, boxes, flips, whole, strict=True):
        pil = picture.resize((32, 32), PILImage.Resampling.BILINEAR, box=(left, top, left + w, top + h))
        if flip:
            pil = pil.transpose(PILImage.Transpose.FLIP_LEFT_RIGHT)
        expected = torch.from_numpy(np.array(pil)).permute(2, 0, 1).float()
        assert (ours.round() - expected).abs().max() <= 1


@pytest.fixture
def cuda_stubs(monkeypatch):
    """prefetch_thread on the CPU, with torch.cuda's streams and events stubbed out; the streams
    made, in a list."""
    import contextlib

    from multigpu.core.loading import prefetch_thread

    made = []

    class Stub:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, *args):
            pass

        def wait_event(self, *args):
            pass

    class Stream(Stub):
        def __init__(self, *args, **kwargs):
            made.append(self)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Stub)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stub())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(prefetch_thread, "map_tensors", lambda fn, obj: obj)
    return made


def test_the_finishing_thread_keeps_order_loads_in_the_callers_thread_and_raises_its_errors(cuda_stubs):
    import threading

    from multigpu.core.loading import prefetch_thread

    caller, loaded_in, finished_in = threading.get_ident(), set(), set()

    def batches(n):
        for i in range(n):
            loaded_in.add(threading.get_ident())  # a 0-worker DataLoader makes samples here
            yield i, torch.tensor([i])

    def finish(batch):
        finished_in.add(threading.get_ident())
        if int(batch) == 3:
            raise ValueError("batch 3 is bad")
        return batch * 10

    got = []
    with pytest.raises(ValueError, match="batch 3 is bad"):
        for info, batch in prefetch_thread.finish_in_thread(batches(6), CPU, finish):
            got.append((info, int(batch)))
    assert got == [(0, 0), (1, 10), (2, 20)]
    assert loaded_in == {caller} and caller not in finished_in

    early = prefetch_thread.finish_in_thread(batches(100), CPU, lambda b: b)
    assert next(early)[0] == 0
    early.close()  # a consumer that stops: the helper is shut down, nothing left running
    assert not [t for t in threading.enumerate() if t.name.startswith("multigpu-finish")]


def test_three_finishing_threads_finish_three_batches_at_once_each_on_its_stream_in_order(cuda_stubs):
    """Each finish waits until three are under way: one helper, or helpers that took turns, would
    break the barrier (its timeout) and fail here."""
    import threading

    from multigpu.core.loading import prefetch_thread

    together = threading.Barrier(3, timeout=20)
    finished_in = set()

    def finish(batch):
        finished_in.add(threading.get_ident())
        if int(batch) < 6:  # two rounds of three at once; the last batches as they come
            together.wait()
        return batch * 10

    batches = ((i, torch.tensor([i])) for i in range(8))
    got = [(info, int(batch)) for info, batch in prefetch_thread.finish_in_thread(batches, CPU, finish, threads=3)]
    assert got == [(i, 10 * i) for i in range(8)]
    assert len(finished_in) == 3 and len(cuda_stubs) == 3  # a stream per helper, made once
    assert not [t for t in threading.enumerate() if t.name.startswith("multigpu-finish")]


def test_a_walk_past_a_bad_file_stays_on_the_cpu_and_counts_each_file_once(tmp_path):
    def truncated(path):
        whole = (tmp_path / "val/a/0.jpg").read_bytes()
        path.write_bytes(whole[: len(whole) // 2])  # no end marker: the CPU path, unreadable

    def broken_body(path):  # a header and an end marker: sent to the device, unreadable there
        whole = (tmp_path / "val/a/0.jpg").read_bytes()
        path.write_bytes(whole[:whole.index(b"\xff\xda")] + b"\xff\xda\x00\x02" + b"\xff\xd9")

    extra = {"train/a/y1.jpg": truncated, "train/a/y2.jpg": broken_body}
    train = folder_data(make_folder(tmp_path, extra=extra)).train
    batch = gpu_images.collate(samples(train, on_gpu=True))  # y1's walk reads y2 on the CPU
    train.on_device(batch, CPU)  # y2's own sample fails on the device
    assert train.bad_count == 2


def test_every_decoder_moves_torchs_generator_alike_with_0_workers(tmp_path):
    train = folder_data(make_folder(tmp_path)).train
    states = []
    for on_gpu in (False, True):
        train.on_gpu = on_gpu
        torch.manual_seed(4)
        [train[i] for i in range(len(train))]
        states.append(torch.get_rng_state())
    assert torch.equal(*states)
