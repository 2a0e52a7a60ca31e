"""shards: data: WebDataset tar shards (written here by webdataset's own TarWriter) read back as the
folder they came from, sample for sample; their index; broken shards and labels in one line."""
from __future__ import annotations

import json
import os
import pickle
import tarfile

import pytest
import torch
from torch.utils.data import DataLoader

import multigpu
from multigpu.core.errors import UsageError
from multigpu.core.loading.loaders import PerSampleSeed, shard_loader
from multigpu.train.data import gpu_images, imagefolder, shard_index
from multigpu.train.data.datasets import load_data
from multigpu.train.data.shard_layout import check_shards, expand_braces
from tests.unit.test_gpu_images import scene

wds = pytest.importorskip("webdataset")  # the dev extra: shards as the library itself writes them
CPU = torch.device("cpu")


def make_folder(root, per_class=4):
    """An image folder whose names have dots, JPEGs and PNGs, RGBA and CMYK among them."""
    for split in ("train", "val"):
        for c, name in enumerate(("cat", "dog")):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                image = scene(40 + 9 * i, 30 + 5 * c, seed=10 * c + i)
                if i == 1:
                    image.convert("RGBA").save(root / split / name / f"p.{i}.png")
                elif i == 2:
                    image.convert("CMYK").save(root / split / name / f"c.{i}.jpg", quality=90)
                else:
                    image.save(root / split / name / f"img.v{i}.jpg", quality=90)
    return root


def write_shards(folder, out, per_shard=3, label="cls"):
    """Each split of `folder` as webdataset's TarWriter writes it: keys with sub-folders and dots,
    the label as KEY.cls or KEY.json; `per_shard` samples a shard, in the folder's order."""
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        samples = imagefolder.load_folder(str(folder), 8).__dict__[split].samples
        for start in range(0, len(samples), per_shard):
            with wds.TarWriter(str(out / f"{split}-{start // per_shard:06d}.tar")) as sink:
                for path, y in samples[start:start + per_shard]:
                    rel = os.path.relpath(path, folder / split)
                    key, ext = os.path.splitext(rel)
                    sample = {"__key__": key, ext[1:]: open(path, "rb").read()}
                    sample.update({"cls": y} if label == "cls" else {"json": {"label": y}})
                    sink.write(sample)
    return out


@pytest.mark.parametrize("label", ["cls", "json"])
def test_shards_written_by_webdataset_read_back_as_the_folder(tmp_path, label):
    folder = make_folder(tmp_path / "imgs")
    shards = write_shards(folder, tmp_path / "shards", label=label)
    (shards / "classes.json").write_text(json.dumps({"classes": ["cat", "dog"]}))
    packed = load_data(f"shards:{shards}", input_kind="image", image_size=16)
    plain = load_data(f"folder:{folder}", input_kind="image", image_size=16)
    assert (packed.num_outputs, packed.input_shape, packed.normalize) == (2, (3, 16, 16), plain.normalize)
    for split in ("train", "val"):
        a, b = getattr(packed, split), getattr(plain, split)
        assert a.classes == ["cat", "dog"] and len(a) == len(b) == 8
        assert [y for _, y in a.samples] == [y for _, y in b.samples] == [0] * 4 + [1] * 4
        for i in range(len(a)):
            assert bytes(a._data(i).numpy()) == open(b.samples[i][0], "rb").read()
        for (x, y), (x2, y2) in zip(every(a), every(b)):  # same crops, same pixels
            assert torch.equal(x, x2) and y == y2
    pickle.loads(pickle.dumps(packed.train))  # for loader workers


def every(dataset, seed=3, epoch=0):
    seeded = PerSampleSeed(dataset, seed)
    return [seeded[(epoch, i)] for i in range(len(dataset))]


def test_without_classes_json_the_classes_are_the_indices_and_patterns_pick_shards(tmp_path):
    shards = write_shards(make_folder(tmp_path / "imgs"), tmp_path / "shards")
    spec = f"shards:train={shards}/train-{{000000..000001}}.tar,val={shards}/val-{{000000,000002}}.tar"
    data = load_data(spec, input_kind="image", image_size=8)
    assert data.train.classes == ["0", "1"] and (len(data.train), len(data.val)) == (6, 5)
    assert expand_braces("a{1..3}-{x,y}") == ["a1-x", "a1-y", "a2-x", "a2-y", "a3-x", "a3-y"]
    assert expand_braces("t-{008..010}.tar") == ["t-008.tar", "t-009.tar", "t-010.tar"]


def test_a_truncated_shard_is_refused_in_one_line_naming_it(tmp_path):
    shards = write_shards(make_folder(tmp_path / "imgs"), tmp_path / "shards")
    shard = shards / "train-000001.tar"
    data = shard.read_bytes()
    last = [m for m in tarfile.open(shard)][-1]
    for cut in (3000, last.offset_data + 10, last.offset_data + last.size + 10):  # early, late, at the end
        shard.write_bytes(data[:cut])
        with pytest.raises(UsageError) as excinfo:
            check_shards(str(shards))
        message = str(excinfo.value)
        assert message.startswith(f"shard '{shard}' is truncated (") and "\n" not in message
        assert message.endswith("copy it again or write it again (multigpu pack)")


def test_a_member_without_a_label_is_refused_naming_shard_and_key(tmp_path):
    shards = tmp_path / "shards"
    write_shards(make_folder(tmp_path / "imgs"), shards)
    with wds.TarWriter(str(shards / "val-000009.tar")) as sink:
        sink.write({"__key__": "dog/x.y", "jpg": b"\xff\xd8 not read"})
    with pytest.raises(UsageError, match=r"^shard '.*val-000009.tar': member 'dog/x.y.jpg' has no "
                                         r"label \(dog/x.y.cls or dog/x.y.json\): every image"):
        check_shards(str(shards))


def test_labels_outside_the_classes_are_refused_in_one_line(tmp_path):
    shards = write_shards(make_folder(tmp_path / "imgs"), tmp_path / "shards")
    (shards / "classes.json").write_text(json.dumps({"classes": ["cat", "dog"]}))
    with wds.TarWriter(str(shards / "val-000009.tar")) as sink:
        sink.write({"__key__": "k", "png": b"x", "cls": 2})
    with pytest.raises(UsageError, match=r"^shard '.*val-000009.tar': key 'k' has label 2, "
                                         r"outside 0..1 \(the 2 classes of classes.json"):
        load_data(f"shards:{shards}", input_kind="image", image_size=8)
    with wds.TarWriter(str(shards / "val-000009.tar")) as sink:
        sink.write({"__key__": "k", "png": b"x", "cls": "dog"})
    with pytest.raises(UsageError, match=r"label member 'k.cls' holds 'dog', not a class index"):
        check_shards(str(shards))


def test_the_index_is_built_once_kept_beside_the_shard_and_rebuilt_when_it_changes(tmp_path, monkeypatch):
    shards = write_shards(make_folder(tmp_path / "imgs"), tmp_path / "shards")
    check_shards(str(shards))  # the launcher's check builds them
    assert sorted(p.name for p in shards.glob("*.idx.json"))[:2] == ["train-000000.tar.idx.json",
                                                                     "train-000001.tar.idx.json"]
    real_scan = shard_index.scan
    monkeypatch.setattr(shard_index, "scan", lambda shard: pytest.fail(f"{shard} scanned again"))
    assert len(load_data(f"shards:{shards}", input_kind="image", image_size=8).train) == 8
    shard = shards / "train-000000.tar"
    os.utime(shard, ns=(0, 0))  # copied again: another time
    scanned = []
    monkeypatch.setattr(shard_index, "scan", lambda s: scanned.append(s) or real_scan(s))
    assert len(load_data(f"shards:{shards}", input_kind="image", image_size=8).train) == 8
    assert scanned == [shard]


def test_an_index_that_cannot_be_kept_beside_the_shard_goes_to_the_cache(tmp_path, monkeypatch):
    shards = write_shards(make_folder(tmp_path / "imgs"), tmp_path / "shards")
    monkeypatch.setenv("MULTIGPU_CACHE_DIR", str(tmp_path / "cache"))
    (shards / "train-000000.tar.idx.json").mkdir()  # stands in for a read-only folder (root here)
    check_shards(str(shards))
    assert len(list((tmp_path / "cache" / "shard-index").glob("*.json"))) == 1
    monkeypatch.setattr(shard_index, "scan", lambda shard: pytest.fail(f"{shard} scanned again"))
    check_shards(str(shards))


@pytest.mark.parametrize("bad_images", ["skip", "fail"])
def test_a_damaged_member_is_named_by_shard_and_key(tmp_path, bad_images, capsys):
    shards = write_shards(make_folder(tmp_path / "imgs"), tmp_path / "shards")
    with wds.TarWriter(str(shards / "train-000000.tar")) as sink:
        sink.write({"__key__": "cat/broken", "jpg": b"\xff\xd8 half a jpeg", "cls": 0})
        sink.write({"__key__": "cat/fine", "png": (tmp_path / "imgs/train/cat/p.1.png").read_bytes(),
                    "cls": 0})
    train = load_data(f"shards:{shards}", input_kind="image", image_size=8,
                      bad_images=bad_images).train
    name = f"{shards / 'train-000000.tar'}:cat/broken.jpg"
    if bad_images == "fail":
        with pytest.raises(imagefolder.BadImageError, match=f"^cannot read image '{name}' .*write "
                                                            r"the shard again \(multigpu pack\)"):
            train[0]
        return
    torch.manual_seed(0)
    replaced = train[0][0]
    torch.manual_seed(0)
    assert torch.equal(replaced, train[1][0]) and train.bad_count == 1
    assert (f"skipped unreadable image '{name}' (cannot identify image file 'cat/broken.jpg'); the "
            "next image") in capsys.readouterr().err


def test_the_device_path_decodes_the_bytes_from_the_shard_as_the_workers_do(tmp_path):
    shards = write_shards(make_folder(tmp_path / "imgs"), tmp_path / "shards")
    train = load_data(f"shards:{shards}", input_kind="image", image_size=16).train
    cpu = torch.stack([x for x, _ in every(train)])
    train.on_gpu = True
    encoded = every(train)
    # the baseline RGB JPEGs leave the workers encoded (c.2.jpg is CMYK, p.1.png a PNG: decoded)
    assert [isinstance(x, gpu_images.EncodedImage) for x, _ in encoded] == [False, True, True, False] * 2
    x, y = train.on_device(gpu_images.collate(encoded), CPU)
    assert y.tolist() == [0] * 4 + [1] * 4
    assert (x.float() - cpu.float()).abs().mean() < 1.5  # rounding only, as folder:'s device path


def test_the_library_class_with_two_workers_gives_every_sample_once_an_epoch(tmp_path):
    shards = write_shards(make_folder(tmp_path / "imgs"), tmp_path / "shards")
    train = multigpu.ShardedImages(shards, "train", image_size=8)
    assert (train.train, train.classes, len(train)) == (True, ["0", "1"], 8)
    val = multigpu.ShardedImages(f"{shards}/val-{{000000..000002}}.tar", "val", image_size=8,
                                 classes=["cat", "dog"])
    assert (val.train, len(val)) == (False, 8)
    loader = shard_loader(DataLoader(train, batch_size=3, shuffle=True, num_workers=2),
                          layout=(1, 0, 1), device=CPU, seed=5,
                          on_step=lambda info: None)
    want = sorted(bytes(x.numpy()) for x, _ in every(train, seed=5))
    got = sorted(bytes(x.numpy()) for images, _ in loader for x in images)
    assert got == want


def test_a_folder_of_shards_given_without_its_form_is_named_with_it(tmp_path):
    shards = write_shards(make_folder(tmp_path / "imgs"), tmp_path / "shards")
    with pytest.raises(UsageError) as excinfo:
        load_data(str(shards), input_kind="image", image_size=8)
    assert str(excinfo.value) == (f"unknown data spec {str(shards)!r}: it is a folder of tar "
                                  "shards; for WebDataset shards (train-*.tar, val-*.tar) use "
                                  f"--data shards:{shards}")


def test_doctor_says_what_the_shards_hold_warns_of_an_index_in_the_cache_and_fails_a_truncated_shard(
        tmp_path, monkeypatch, capsys):
    from multigpu import cli

    shards = write_shards(make_folder(tmp_path / "imgs"), tmp_path / "shards")
    monkeypatch.setenv("MULTIGPU_CACHE_DIR", str(tmp_path / "cache"))
    (shards / "val-000002.tar.idx.json").mkdir()  # that index cannot be kept beside its shard
    argv = ["doctor", "--model", "cnn", "--data", f"shards:{shards}", "--image-size", "8",
            "--batch-size", "2", "--devices", "cpu:2", "--no-step"]
    assert cli.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "shards  " in line]
    assert lines[0] == ("ok    shards         8 train / 8 val images in 3 + 3 shards, 2 classes; read at "
                        "random through their indexes: every sample once an epoch, on any device count")
    assert lines[1].startswith(f"warn  shards         no classes.json beside the shards in {shards}: ")
    assert lines[2].startswith(f"warn  shards         1 shard indexes are in {tmp_path / 'cache' / 'shard-index'}, "
                               "not beside the shards (their folder cannot be written)")
    shard = shards / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert f"fail  options        shard '{shard}' is truncated (" in out


def test_a_process_keeps_few_shards_open_however_many_it_reads(tmp_path, monkeypatch):
    from multigpu.train.data import shards as shards_module

    shards = write_shards(make_folder(tmp_path / "imgs"), tmp_path / "shards", per_shard=2)
    monkeypatch.setattr(shards_module, "_OPEN_FILES", 2, raising=False)
    train = load_data(f"shards:{shards}", input_kind="image", image_size=8).train
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        got = [bytes(train._data(i).numpy()) for i in range(len(train))]  # 4 shards in turn
        assert len(os.listdir("/proc/self/fd")) <= before + 2
    plain = load_data(f"folder:{tmp_path / 'imgs'}", input_kind="image", image_size=8).train
    assert got == [open(p, "rb").read() for p, _ in plain.samples]
