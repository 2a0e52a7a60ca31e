"""fileio: whole files or none, readable like the user's other files."""
import os
import stat

import pytest

from multigpu.core.system import fileio


def test_a_written_file_gets_the_mode_of_any_new_file_not_0600(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")  # what open() gives under this process's umask
    path = fileio.atomic_write_text(tmp_path / "a.json", "{}")
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
    assert path.read_text() == "{}"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = fileio.atomic_write_text(tmp_path / "last.pt", "old")

    def half_then_fail(f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        fileio.atomic_write(path, half_then_fail)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["last.pt"]


def test_a_link_is_a_second_name_of_the_same_bytes_and_replaces_atomically(tmp_path):
    src = fileio.atomic_write_text(tmp_path / "step-1.pt", "one")
    dst = fileio.atomic_write_text(tmp_path / "last.pt", "stale")
    fileio.atomic_link(src, dst)
    assert dst.read_text() == "one"
    assert os.stat(src).st_ino == os.stat(dst).st_ino
    src.unlink()  # the step file goes (retention): the other name keeps the bytes
    assert dst.read_text() == "one"
    assert sorted(os.listdir(tmp_path)) == ["last.pt"]


def test_leftovers_of_interrupted_writes_are_recognisable():
    assert fileio.is_temp_name(".step-000000012.pt.a8f3k2.tmp")
    assert not fileio.is_temp_name("step-000000012.pt")
    assert not fileio.is_temp_name(".writer.lock")


def test_the_hash_taken_while_writing_is_the_file_s_even_when_the_writer_seeks_back(tmp_path):
    import hashlib

    import torch

    state = {"w": torch.randn(300, 300), "steps": [1, {"b": torch.arange(7)}]}
    path, sha = fileio.atomic_write_hashed(tmp_path / "a.pt", lambda f: torch.save(state, f))
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()

    def patch_header(f):  # writes, then goes back and overwrites its first bytes
        f.write(b"\0" * 8 + b"payload")
        f.seek(0)
        f.write(b"HEADER!!")
    path, sha = fileio.atomic_write_hashed(tmp_path / "b.bin", patch_header)
    assert path.read_bytes() == b"HEADER!!payload"
    assert sha == hashlib.sha256(b"HEADER!!payload").hexdigest()


def test_a_checkpoint_s_hash_comes_from_its_writes_and_a_write_past_them_reads_the_file_back(
        tmp_path, monkeypatch):
    import hashlib

    import torch

    def no_read_back(path):
        raise AssertionError("torch.save's file was read back to hash it")
    monkeypatch.setattr(fileio, "sha256_file", no_read_back)
    fileio.atomic_write_hashed(tmp_path / "a.pt", lambda f: torch.save({"w": torch.ones(9)}, f))
    monkeypatch.undo()

    def through_the_descriptor(f):  # bytes the wrapper never sees
        f.write(b"seen")
        os.write(f.fileno(), b"unseen")
    path, sha = fileio.atomic_write_hashed(tmp_path / "b.bin", through_the_descriptor)
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
