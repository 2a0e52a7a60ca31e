"""`multigpu pack`: an image folder into tar shards, bytes unchanged, each image in exactly one
shard, in a seeded shuffled order; stopped and started again it goes on; nothing in --out that is
not its own is replaced."""
from __future__ import annotations

import json
import os

import pytest

from multigpu import cli
from multigpu.core.errors import UsageError
from multigpu.train.data import shard_pack
from multigpu.train.data.shards import load_shards
from tests.unit.test_shards import make_folder

wds = pytest.importorskip("webdataset")


def files_of(folder, split):
    """{bytes: class name} of a split's images (the test images are all different)."""
    return {p.read_bytes(): p.parent.name for p in (folder / split).glob("*/*")}


def test_every_image_is_in_exactly_one_shard_unchanged_shuffled_and_webdataset_reads_them(tmp_path, capsys):
    folder = make_folder(tmp_path / "imgs", per_class=8)
    assert cli.main(["pack", f"folder:{folder}", "--out", str(tmp_path / "out"), "--shard-size", "12KB"]) == 0
    out = tmp_path / "out"
    said = capsys.readouterr().out
    assert said.startswith("packed 16 train and 16 val images of 2 classes into ")
    listed = json.loads((out / "classes.json").read_text())
    assert listed["classes"] == ["cat", "dog"] and listed["counts"]["train"] == {"cat": 8, "dog": 8}
    assert len(listed["shards"]["train"]) > 2
    assert sum(s["nsamples"] for s in listed["shards"]["train"]) == 16
    data = load_shards(str(out), image_size=8)
    for split in ("train", "val"):
        dataset = getattr(data, split)
        packed = [(bytes(dataset._data(i).numpy()), dataset.classes[y])
                  for i, (_, y) in enumerate(dataset.samples)]
        assert dict(packed) == files_of(folder, split) and len(packed) == 16
    labels = [y for _, y in data.train.samples]
    assert labels != sorted(labels), "shuffled: a reader in order does not read one class, then the other"
    last = len(listed["shards"]["train"]) - 1
    read = list(wds.WebDataset(f"{out}/train-{{000000..{last:06d}}}.tar", shardshuffle=False))
    assert [int(s["cls"]) for s in read] == labels  # webdataset's own reader: same keys, same labels


def test_the_same_seed_packs_the_same_bytes_and_another_seed_another_order(tmp_path):
    folder = make_folder(tmp_path / "imgs")
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        shard_pack.pack(str(folder), tmp_path / name, seed=seed, shard_size=10**6)
    shard = "train-000000.tar"
    assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()
    assert (tmp_path / "a" / shard).read_bytes() != (tmp_path / "c" / shard).read_bytes()


def test_a_pack_stopped_midway_goes_on_to_the_same_shards(tmp_path):
    folder = make_folder(tmp_path / "imgs", per_class=8)
    shard_pack.pack(str(folder), tmp_path / "whole", shard_size=6000)

    done = []

    def ctrl_c_after_two(images, total):
        done.append(images)
        if len(done) == 2:
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        shard_pack.pack(str(folder), out, shard_size=6000, progress=ctrl_c_after_two)
    kept = {p.name: os.stat(p).st_ino for p in out.glob("*.tar")}
    assert sorted(kept) == ["train-000000.tar", "train-000001.tar"]
    assert not list(out.glob(".*")) and not (out / "classes.json").exists()  # no half file left
    shard_pack.pack(str(folder), out, shard_size=6000)
    assert {n: os.stat(out / n).st_ino for n in kept} == kept, "the whole shards were kept"
    whole = sorted(p.name for p in (tmp_path / "whole").glob("*.tar"))
    assert sorted(p.name for p in out.glob("*.tar")) == whole
    assert all((out / n).read_bytes() == (tmp_path / "whole" / n).read_bytes() for n in whole)


def test_shards_in_out_that_are_not_this_packing_are_left_as_they_are(tmp_path):
    folder = make_folder(tmp_path / "imgs", per_class=8)
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-000000.tar").write_bytes(b"someone's")
    with pytest.raises(UsageError, match=r"^--out .*: train-000000.tar is there and is not the shard "):
        shard_pack.pack(str(folder), out, shard_size=6000)
    assert (out / "train-000000.tar").read_bytes() == b"someone's"
    (out / "train-000000.tar").unlink()
    (out / "val-000123.tar").write_bytes(b"theirs")
    with pytest.raises(UsageError, match=r"holds shards this packing does not make \(val-000123.tar"):
        shard_pack.pack(str(folder), out, shard_size=6000)
    (out / "val-000123.tar").unlink()
    shard_pack.pack(str(folder), out, shard_size=6000)
    with pytest.raises(UsageError, match=r"holds a packing of other images or arguments"):
        shard_pack.pack(str(folder), out, shard_size=9000)


def test_pack_s_bad_arguments_are_one_line(tmp_path, capsys):
    assert shard_pack.parse_size("1GB") == 10**9 and shard_pack.parse_size("256MiB") == 256 * 2**20
    assert shard_pack.parse_size("4096") == 4096
    for argv, said in (
        (["pack", str(tmp_path), "--out", "x"], f"give the image folder as folder:PATH, e.g. multigpu pack "
                                                f"folder:{tmp_path} --out DIR"),
        (["pack", f"folder:{tmp_path}", "--out", "x", "--shard-size", "big"], "--shard-size big: give a size"),
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("multigpu: error: ") and said in err and err.count("\n") == 1
