"""Every path option of every command that cannot be made or written stops in one line naming
the option, exit 2, before anything is made or started (issue 40, item 2: tracebacks before)."""
import pytest

from multigpu.core.errors import UsageError
from multigpu.core.system.fileio import check_can_make

PROC = "nothing can be made in /proc (No such file or directory); give a folder you can write"
FILE = "f.pt is a file, not a folder; give a path whose parents are folders"


@pytest.mark.parametrize("argv, said", [
    (["train", "--model", "mlp", "--data", "digits", "--out", "/proc/x"], f"--out /proc/x: {PROC}"),
    (["train", "--model", "mlp", "--data", "digits", "--out", "f.pt/run1"], f"--out f.pt/run1: {FILE}"),
    (["train", "--model", "mlp", "--data", "digits", "--log-dir", "/proc/x"],
     f"--log-dir /proc/x: {PROC}"),
    (["sweep", "--grid", "seed=1", "--out", "/proc/x", "--", "echo", "{seed}"], f"--out /proc/x: {PROC}"),
    (["sweep", "--grid", "seed=1", "--out", "f.pt/x", "--", "echo", "{seed}"], f"--out f.pt/x: {FILE}"),
    (["run", "--log-dir", "/proc/x", "--devices", "cpu:2", "s.py"], f"--log-dir /proc/x: {PROC}"),
    (["test", "--log-dir", "/proc/x"], f"--log-dir /proc/x: {PROC}"),
    (["test", "--checkpoint-dir", "f.pt"], "--checkpoint-dir f.pt: a file is there, not a folder; "
                                           "give another path"),
    (["bench", "--out", "/proc/x"], f"--out /proc/x: {PROC}"),
    (["bench", "--data", "real", "--data-dir", "/proc/x"], f"--data-dir /proc/x: {PROC}"),
    (["export", "--out", "/proc/x.pt", "run"], f"--out /proc/x.pt: {PROC}"),
    (["plot", "--out", "f.pt/curves.png", "run"], f"--out f.pt/curves.png: {FILE}"),
    (["pack", "folder:run", "--out", "/proc/x"], f"--out /proc/x: {PROC}"),
])
def test_a_path_that_cannot_be_made_is_one_line_and_nothing_is_made(argv, said, tmp_path,
                                                                     monkeypatch, capsys):
    from multigpu import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.pt").write_bytes(b"the user's file")
    (tmp_path / "s.py").write_text("print('ran')\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"epoch": 1, "train_loss": 1.0}\n')
    if argv[0] == "export":
        pytest.importorskip("torch")
        import torch

        (tmp_path / "run" / "checkpoints").mkdir()
        torch.save({"model": {}, "step": 1}, tmp_path / "run" / "checkpoints" / "step_1.pt")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"multigpu: error: {said}"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "f.pt").read_bytes() == b"the user's file"


def test_a_folder_path_is_tried_where_it_would_be_made_and_leaves_nothing(tmp_path):
    check_can_make(tmp_path / "a" / "b", "--out")  # can be made: no error
    check_can_make(tmp_path, "--out")  # a folder that exists and can be written
    check_can_make(tmp_path / "x.png", "--out", file=True)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError) as folder_for_a_file:
        check_can_make(tmp_path, "--out", file=True)
    assert str(folder_for_a_file.value) == (f"--out {tmp_path}: that is a folder; give a file's "
                                            f"path in it, e.g. --out {tmp_path / 'out'}")
