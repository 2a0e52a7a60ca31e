"""--auto's files on a rank other than 0 (multigpu.auto.writes.files): what it writes lands in its own
copies, it reads those back, and the user's folder stays as rank 0 leaves it. Here one process
plays rank 1 in a folder of its own; tests/multiproc/test_auto_files.py runs the real thing."""
import glob
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest

from multigpu.auto.writes import files, overlay


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """(the user's folder, the rank's copies, a passing folder); cwd the user's folder."""
    user, copies, passing = tmp_path / "user", tmp_path / "copies", tmp_path / "passing"
    for folder in (user, copies, passing):
        folder.mkdir()
    monkeypatch.chdir(user)
    yield user, copies, passing
    files.uninstall()


def as_rank1(copies: Path, passing: Path) -> None:
    """This process, from here on: rank 1 of a run whose folders tmp_path holds (the temp
    folder, which holds them, is tracked here)."""
    view = overlay.Overlay(str(copies), (str(passing),))
    files.patch(files._patches(view))
    files._installed["overlay"] = view


def copy(copies: Path, path: Path) -> Path:
    return Path(str(copies) + str(path))


def test_a_write_lands_in_the_ranks_copy_and_is_read_back_there(folders):
    user, copies, passing = folders
    (user / "old.txt").write_text("the user's")
    as_rank1(copies, passing)
    with open("log.txt", "w") as f:
        f.write("rank 1's")
        assert f.name == "log.txt"
    np.save("arr.npy", np.arange(3))
    with open("old.txt", "a") as f:  # append: the user's text first, copied in
        f.write(" and rank 1's")
    assert open("log.txt").read() == "rank 1's"
    assert np.load("arr.npy").tolist() == [0, 1, 2]
    assert Path("old.txt").read_text() == "the user's and rank 1's"
    assert os.path.getsize("log.txt") == 8 and os.path.isfile("arr.npy")
    assert sorted(os.listdir(".")) == ["arr.npy", "log.txt", "old.txt"]
    files.uninstall()
    assert os.listdir(user) == ["old.txt"] and (user / "old.txt").read_text() == "the user's"
    assert copy(copies, user / "log.txt").read_text() == "rank 1's"


def test_folders_made_deleted_and_renamed_only_in_the_copies(folders):
    user, copies, passing = folders
    (user / "data" / "raw").mkdir(parents=True)
    (user / "data" / "raw" / "a.bin").write_bytes(b"user")
    as_rank1(copies, passing)
    os.makedirs("out/samples", exist_ok=True)
    Path("out/samples/0.txt").write_text("zero")
    shutil.copyfile("out/samples/0.txt", "out/best.txt")
    os.replace("out/best.txt", "out/final.txt")
    assert sorted(os.listdir("out")) == ["final.txt", "samples"]
    assert [p.name for p in Path("out").iterdir()] == ["final.txt", "samples"]
    assert sorted(glob.glob("out/**/*.txt", recursive=True)) == ["out/final.txt",
                                                                "out/samples/0.txt"]
    assert [(d, sorted(fs)) for d, _, fs in os.walk("out")] == [("out", ["final.txt"]),
                                                               ("out/samples", ["0.txt"])]
    shutil.rmtree("data")  # the user's folder: hidden from this rank, not deleted
    assert not os.path.exists("data") and not os.path.exists("data/raw/a.bin")
    with pytest.raises(FileNotFoundError):
        open("data/raw/a.bin", "rb")
    os.makedirs("data/raw")  # made again: empty, as on one process
    assert os.listdir("data/raw") == []
    Path("data/raw/a.bin").write_bytes(b"rank 1")
    assert Path("data/raw/a.bin").read_bytes() == b"rank 1"
    os.remove("out/final.txt")
    assert not os.path.exists("out/final.txt") and os.listdir("out") == ["samples"]
    files.uninstall()
    assert sorted(str(p.relative_to(user)) for p in user.rglob("*")) == [
        "data", "data/raw", "data/raw/a.bin"]
    assert (user / "data/raw/a.bin").read_bytes() == b"user"
    assert copy(copies, user / "data/raw/a.bin").read_bytes() == b"rank 1"


def test_deleting_the_users_file_hides_it_from_the_rank_only(folders):
    user, copies, passing = folders
    (user / "ckpt_0.txt").write_text("0")
    as_rank1(copies, passing)
    os.remove("ckpt_0.txt")
    assert glob.glob("ckpt_*") == [] and not Path("ckpt_0.txt").exists()
    with pytest.raises(FileNotFoundError):
        os.remove("ckpt_0.txt")
    Path("ckpt_0.txt").write_text("written again")
    assert glob.glob("ckpt_*") == ["ckpt_0.txt"]
    assert Path("ckpt_0.txt").read_text() == "written again"
    files.uninstall()
    assert (user / "ckpt_0.txt").read_text() == "0"


def test_a_folder_rank_0_has_just_made_is_the_ranks_own_to_make(folders):
    user, copies, passing = folders
    as_rank1(copies, passing)
    overlay.real.mkdir(user / "out")  # rank 0 was first (past the overlay, as rank 0 makes it)
    os.makedirs("out")
    with pytest.raises(FileExistsError):
        os.makedirs("out")  # this rank's own, made already
    with pytest.raises(FileNotFoundError):
        open("missing/x.txt", "w")  # as on one process: no folder, no file


def test_a_file_written_beside_then_renamed_over_as_libraries_write_whole(folders):
    user, copies, passing = folders
    (user / "config.json").write_text("the user's")
    as_rank1(copies, passing)
    with tempfile.NamedTemporaryFile("w", dir=".", delete=False) as f:  # os.open, O_EXCL
        f.write("rank 1's")
    os.replace(f.name, "config.json")
    Path("stamp").touch()
    with open("new.txt", "x") as f:
        f.write("x")
    assert Path("config.json").read_text() == "rank 1's"
    assert sorted(os.listdir(".")) == ["config.json", "new.txt", "stamp"]
    files.uninstall()
    assert os.listdir(user) == ["config.json"]
    assert (user / "config.json").read_text() == "the user's"


def test_an_archive_extracted_as_a_download_does_it(folders):
    user, copies, passing = folders
    (user / "member.txt").write_text("in the archive")
    with tarfile.open(user / "data.tar.gz", "w:gz") as tar:
        tar.add(user / "member.txt", arcname="raw/member.txt")
    (user / "member.txt").unlink()
    as_rank1(copies, passing)
    os.makedirs("data", exist_ok=True)
    with tarfile.open("data.tar.gz") as tar:
        tar.extractall("data")
    assert Path("data/raw/member.txt").read_text() == "in the archive"
    files.uninstall()
    assert os.listdir(user) == ["data.tar.gz"]
    assert copy(copies, user / "data/raw/member.txt").read_text() == "in the archive"


def test_a_tensorboard_writer_names_its_files_by_bytes(folders):
    from torch.utils.tensorboard import SummaryWriter

    user, copies, passing = folders
    as_rank1(copies, passing)
    writer = SummaryWriter("runs/exp")
    writer.add_scalar("loss", 1.0, 0)
    writer.close()
    [events] = os.listdir("runs/exp")
    assert events.startswith("events.out.tfevents.") and os.path.getsize(f"runs/exp/{events}")
    files.uninstall()
    assert os.listdir(user) == []
    assert os.listdir(copy(copies, user / "runs/exp")) == [events]


def test_safetensors_written_in_rust_as_save_pretrained_writes_it(folders):
    import safetensors
    import safetensors.torch as st
    import torch

    user, copies, passing = folders
    as_rank1(copies, passing)  # before the script imports save_file (transformers does so)
    os.makedirs("out")
    st.save_file({"w": torch.arange(4.0)}, "out/model.safetensors", metadata={"format": "pt"})
    assert st.load_file("out/model.safetensors")["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with safetensors.safe_open("out/model.safetensors", framework="pt") as f:
        assert list(f.keys()) == ["w"]
    files.uninstall()
    assert os.listdir(user) == []
    saved = st.load_file(copy(copies, user / "out/model.safetensors"))
    assert saved["w"].tolist() == [0, 1, 2, 3]


def test_what_passes_untouched(folders):
    user, copies, passing = folders
    as_rank1(copies, passing)
    (passing / "cache.bin").write_bytes(b"shared")
    with open(os.open(passing / "lock", os.O_CREAT | os.O_WRONLY), "w") as f:
        f.write("x")
    Path("tmp.txt").write_text("mine")
    os.replace("tmp.txt", passing / "moved.txt")  # out of the user's folder: a passing one
    files.uninstall()
    assert sorted(os.listdir(passing)) == ["cache.bin", "lock", "moved.txt"]
    assert os.listdir(user) == []


def test_the_paths_it_tracks(monkeypatch):
    monkeypatch.chdir("/")  # relative paths below resolve outside /tmp wherever the clone is
    paths = overlay.Overlay("/logs/files/rank1", ("/tmp", "/logs"))
    assert paths.key("/home/u/out.png") == "/home/u/out.png"
    assert paths.key("/home/u/../u/./out.png") == "/home/u/out.png"
    assert paths.key(Path("/home/u/out.png")) == "/home/u/out.png"
    for relative in ("out.png", "./out.png", "a//b/", "a/../out.png", ""):
        assert paths.key(relative) == os.path.abspath(relative), relative
    assert paths.key("/tmp/x") is None and paths.key("/tmp") is None
    assert paths.key("/tmpfiles/x") == "/tmpfiles/x"
    assert paths.key("/logs/files/rank1/home/u/out.png") is None
    assert paths.key(3) is None and paths.key(b"/home/u/out.png") == "/home/u/out.png"
    assert paths.copy_of("/home/u/out.png") == "/logs/files/rank1/home/u/out.png"
    paths.record("/home/u/out", overlay.GONE, folder=True)
    assert paths.seen("/home/u/out/a/b.png") == overlay.GONE
    assert paths.seen("/home/u/outer.png") is None and paths.seen("/home/u") is None
    paths.record("/home/u/out/a/b.png", overlay.OWN)
    assert paths.seen("/home/u/out/a/b.png") == overlay.OWN
    paths.forget("/home/u/out")
    assert paths.seen("/home/u/out/a/c.png") is None
