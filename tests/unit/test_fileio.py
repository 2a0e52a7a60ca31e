"""fileio: whole files or none, readable like the user's other files."""
import os
import stat

import pytest

from multigpu import fileio


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
