"""The GPU path's JPEG decoders (jpeg_decoders): which one a device gets, what its probe says
when none works, and nvImageCodec itself through its CPU backend (libjpeg-turbo), the part of it
that runs without a GPU; tests/gpu/test_decode_gpu.py runs it on the hardware engines.

The nvImageCodec tests skip where `nvidia-nvimgcodec-cu13` is not installed:
pip install 'multigpu[nvimgcodec]' (or PYTHONPATH=a folder the two wheels were installed to)."""
import io
import sys

import pytest
import torch

from multigpu.core.errors import UsageError
from multigpu.train.data import gpu_images, imagefolder, jpeg_decoders
from tests.unit.test_gpu_images import folder_data, make_folder, samples, scene

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    """Each test chooses anew (the choice is cached per process and device)."""
    monkeypatch.setattr(jpeg_decoders, "_chosen", {})


def nvimgcodec_or_skip():
    try:
        return jpeg_decoders.import_nvimgcodec()
    except ImportError:
        pytest.skip("nvidia-nvimgcodec-cu13 is not installed")


def jpeg(picture, **save):
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=90, **save)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def pil_pixels(data):
    return jpeg_decoders.pil_decode(data).float()


def test_with_neither_decoder_the_problem_names_both_and_how_to_get_nvimagecodec(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    problem = ("nvImageCodec is not installed (pip install 'multigpu[nvimgcodec]'); torchvision does not "
               "import (ModuleNotFoundError: import of torchvision.io halted; None in sys.modules)")
    assert gpu_images.gpu_decode_problem(GPU) == problem
    with pytest.raises(UsageError) as excinfo:
        imagefolder.use_decode(folder_data(make_folder(tmp_path)), "gpu", GPU, workers=2)
    assert str(excinfo.value) == (f"--decode gpu: {problem}; use --decode cpu (the loader workers decode) "
                                  "or auto")
    assert gpu_images.gpu_decode_problem(CPU) == "the run's device is cpu, not a GPU"


def test_nvimagecodec_without_a_gpu_is_named_in_one_line_and_its_library_noise_held_back(capfd):
    nvimgcodec_or_skip()
    capfd.readouterr()
    problem = gpu_images.gpu_decode_problem(GPU)  # this machine has no GPU: nothing can start
    assert problem.startswith("nvImageCodec does not start on cuda:0 (RuntimeError: "), problem
    assert len(problem.splitlines()) == 1
    err = capfd.readouterr().err.lower()
    assert "nvjpeg2000" not in err and "nvtiff" not in err and "libcuda" not in err, err


def test_a_decoder_that_gets_the_colours_wrong_fails_its_probe():
    class Inverting(jpeg_decoders.PilDecoder):
        name = "an inverting decoder"

        def decode(self, encoded, device):
            return [255 - image for image in super().decode(encoded, device)]

    class Refusing(jpeg_decoders.PilDecoder):
        name = "a refusing decoder"

        def decode(self, encoded, device):
            return [None for _ in encoded]

    assert jpeg_decoders.probe_problem(jpeg_decoders.PilDecoder(), CPU) is None
    assert jpeg_decoders.probe_problem(Inverting(), CPU) == "an inverting decoder gave wrong pixels on this device"
    assert jpeg_decoders.probe_problem(Refusing(), CPU) == "a refusing decoder could not decode a JPEG here"


def test_the_startup_line_names_the_decoder_the_device_uses(tmp_path):
    class Named(jpeg_decoders.PilDecoder):
        name = "nvImageCodec, hardware JPEG engines"

    data = folder_data(make_folder(tmp_path))
    jpeg_decoders.use(GPU, Named())  # as if probed on a GPU with the engines
    assert imagefolder.use_decode(data, "gpu", GPU, 15) == (
        "folder: JPEGs decoded on cuda:0 (nvImageCodec, hardware JPEG engines), the crops there too; "
        "15 loader workers read the files (--decode cpu: the workers decode)")


def test_nvimagecodec_decodes_rgb_grey_cmyk_and_progressive_as_pil_does():
    nvimgcodec_or_skip()
    decoder = jpeg_decoders.NvImageCodecDecoder(CPU)
    assert decoder.name == "nvImageCodec, CPU"
    picture = scene(90, 70, seed=5)
    files = [jpeg(picture), jpeg(picture.convert("L")), jpeg(picture.convert("CMYK")),
             jpeg(picture, progressive=True), jpeg(scene(31, 17, seed=6))]
    images = decoder.decode(files, CPU)
    for k, (data, image) in enumerate(zip(files, images, strict=True)):
        expected = pil_pixels(data)
        assert image.dtype == torch.uint8 and image.shape == expected.shape, k
        # libjpeg-turbo both, but PIL upsamples chroma "fancily": a level or two at edges
        assert (image.float() - expected).abs().mean() < 2.5, k


def meeting_inside(decoder, together):
    """`decoder._decoder` made to wait at barrier `together` while it holds a Decoder of the pool:
    calls that took turns, or shared one Decoder, would break the barrier (its timeout)."""
    from contextlib import contextmanager

    held = decoder._decoder

    @contextmanager
    def meeting():
        with held() as one:
            together.wait()
            yield one
    return meeting


def test_nvimagecodec_decodes_from_two_threads_at_once_with_a_decoder_each_and_a_third_waits():
    """Two threads' calls meet while each holds a Decoder of the pool made at the start (a
    barrier: one Decoder for both, or calls in turn, would break it); their pixels are one
    thread's. With a pool of one, a second call waits until the first gives its Decoder back."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import contextmanager

    nvimgcodec_or_skip()
    decoder = jpeg_decoders.NvImageCodecDecoder(CPU)
    assert decoder.pool_size == 2 == decoder.threads
    files = [jpeg(scene(64 + 8 * k, 48, seed=k)) for k in range(6)]
    alone = decoder.decode(files, CPU)
    decoder._decoder = meeting_inside(decoder, threading.Barrier(2, timeout=20))
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: decoder.decode(files, CPU), range(2)))
    for images in results:
        assert all(torch.equal(a, b) for a, b in zip(alone, images, strict=True))

    single = jpeg_decoders.NvImageCodecDecoder(CPU, pool=1)
    let_go, inside = threading.Event(), threading.Event()
    first = single._decoder

    @contextmanager
    def holding():
        with first() as one:
            if not inside.is_set():
                inside.set()
                let_go.wait(20)
            yield one

    single._decoder = holding
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(single.decode, files, CPU)
        assert inside.wait(20)
        b = pool.submit(single.decode, files, CPU)
        with pytest.raises(TimeoutError):
            b.result(timeout=0.5)  # waiting for the one Decoder, not making another
        let_go.set()
        assert all(torch.equal(x, y) for x, y in zip(a.result(20), b.result(20), strict=True))
    assert single.pool_size == 1


def test_transient_decodes_into_the_last_batch_and_gives_what_a_fresh_decode_gives():
    """decode_transient (the crops' call) decodes each batch into the Images of the thread's
    previous one: batches of larger, smaller, fewer and more images than the last, a bad file
    among them, come out as decode gives them, and each thread keeps its own Images."""
    from concurrent.futures import ThreadPoolExecutor

    nvimgcodec_or_skip()
    decoder = jpeg_decoders.NvImageCodecDecoder(CPU)
    garbage = torch.frombuffer(bytearray(b"\xff\xd8 not a jpeg \xff\xd9"), dtype=torch.uint8)
    sizes = (70, 40, 90, 30, 60, 50)  # larger and smaller than the batch before
    batches = [[jpeg(scene(sizes[step] + 9 * k, 30 + 5 * (step % 3), seed=10 * step + k)) for k in range(count)]
               for step, count in enumerate((3, 3, 2, 5, 1, 4))]
    batches[2].insert(1, garbage)
    expected = [decoder.decode(files, CPU) for files in batches]

    def transient(files):
        return [None if image is None else image.clone() for image in decoder.decode_transient(files, CPU)]

    def same(got, want):
        return len(got) == len(want) and all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(got, want, strict=True))

    assert all(same(transient(files), want) for files, want in zip(batches, expected, strict=True))
    # the 5 Images let go at the one-file batch (more than KEPT_AT_MOST times its bytes), the last 4 kept
    assert decoder._reuses and len(decoder._previous.images[1]) == 4
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            got = list(pool.map(transient, batches))
            assert all(same(g, want) for g, want in zip(got, expected, strict=True))


def test_transient_images_kept_grow_no_larger_than_a_batch_needs():
    """The largest file goes into the largest Image kept (a batch of the same sizes in another
    order makes none of them grow), and a thread lets go of Images past KEPT_AT_MOST times the
    bytes of the batch at hand (one huge file, then small ones)."""
    nvimgcodec_or_skip()
    decoder = jpeg_decoders.NvImageCodecDecoder(CPU)

    def held():
        return sum(image.capacity for image in decoder._previous.images[1])

    big, small = jpeg(scene(200, 150, seed=1)), jpeg(scene(20, 15, seed=2))
    decoder.decode_transient([big, small], CPU)
    first = held()
    assert first >= 3 * (200 * 150 + 20 * 15)
    got = decoder.decode_transient([jpeg(scene(20, 15, seed=3)), jpeg(scene(200, 150, seed=4))], CPU)
    assert [tuple(image.shape) for image in got] == [(3, 15, 20), (3, 150, 200)]
    assert held() == first  # the 200x150 file went into the Image that had held one
    huge = [jpeg(scene(800, 600, seed=5))] + [jpeg(scene(20, 15, seed=6 + k)) for k in range(3)]
    decoder.decode_transient(huge, CPU)
    smalls = [jpeg(scene(24, 16, seed=10 + k)) for k in range(4)]
    expected = decoder.decode(smalls, CPU)
    got = decoder.decode_transient(smalls, CPU)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert held() <= 1.2 * 3 * 24 * 16 * 4 * jpeg_decoders.KEPT_AT_MOST  # the 800x600 Image let go


def test_nvimagecodec_gives_none_for_files_it_cannot_read_and_decodes_the_rest():
    nvimgcodec_or_skip()
    good = jpeg(scene(80, 60, seed=1))
    body = bytes(good.numpy())
    truncated = torch.frombuffer(bytearray(body[: len(body) // 2]), dtype=torch.uint8)
    no_scan = torch.frombuffer(bytearray(body[:body.index(b"\xff\xda")] + b"\xff\xda\x00\x02\xff\xd9"),
                               dtype=torch.uint8)
    garbage = torch.frombuffer(bytearray(b"\xff\xd8 not a jpeg \xff\xd9"), dtype=torch.uint8)
    images = jpeg_decoders.NvImageCodecDecoder(CPU).decode([truncated, good, no_scan, garbage, good], CPU)
    assert [image is None for image in images] == [True, False, True, True, False]
    assert torch.equal(images[1], images[4])


def test_the_device_path_with_nvimagecodec_replaces_and_counts_a_bad_file(tmp_path, capsys):
    nvimgcodec_or_skip()

    def broken_body(path):  # a header and an end marker: sent encoded, unreadable by both
        whole = (tmp_path / "val/a/0.jpg").read_bytes()
        path.write_bytes(whole[:whole.index(b"\xff\xda")] + b"\xff\xda\x00\x02" + b"\xff\xd9")

    train = folder_data(make_folder(tmp_path, extra={"train/a/zz.jpg": broken_body})).train
    index = [p for p, _ in train.samples].index(str(tmp_path / "train/a/zz.jpg"))
    cpu = torch.stack([x for x, _ in samples(folder_data(tmp_path).train, on_gpu=False)])
    capsys.readouterr()
    encoded = samples(train, on_gpu=True)
    jpeg_decoders.use(CPU, jpeg_decoders.NvImageCodecDecoder(CPU))
    x, y = train.on_device(gpu_images.collate(encoded), CPU)
    assert train.bad_count == 1 and y[index] == 1, "the next file's label, class b's"
    assert capsys.readouterr().err.count("skipped unreadable image") == 1
    others = [i for i in range(len(train)) if i != index]
    assert (x[others].float() - cpu[others].float()).abs().mean() < 1.0  # the CPU path's crops
