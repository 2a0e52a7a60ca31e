"""`multigpu export` / `--resume` of a source that gives no checkpoint: the line says why and names it."""
import os
import shutil

from multigpu import cli


def test_a_run_folder_without_checkpoints_is_told_apart_from_a_folder_of_yours(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--model", "linear", "--data", "synthetic:48", "--batch-size", "16",
                     "--epochs", "1", "--devices", "cpu:1", "--image-size", "8", "--logger",
                     "none", "--out", "run"]) == 0
    shutil.copytree("run", "deleted")
    shutil.rmtree("deleted/checkpoints")  # the user deleted the checkpoints folder
    shutil.copytree("run", "emptied")
    for path in (tmp_path / "emptied" / "checkpoints").iterdir():
        path.unlink()  # ... or every checkpoint in it
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    capsys.readouterr()

    said = {}
    for folder in ("deleted", "emptied", "mine"):
        assert cli.main(["export", folder]) == 2
        said[folder] = capsys.readouterr().err
    assert said == {
        "deleted": "multigpu: error: export deleted: no checkpoint there: a run folder without "
                   "its checkpoints/ folder (deleted?); give a checkpoint file, or another run "
                   "folder\n",
        "emptied": "multigpu: error: export emptied: no checkpoint there: emptied/checkpoints "
                   "holds none (the run saved none yet, or they were deleted); give a checkpoint "
                   "file, or another run folder\n",
        "mine": "multigpu: error: export mine: no checkpoint there (expected a .pt file, or a run "
                "folder with checkpoints/)\n"}
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def test_a_cut_or_changed_checkpoint_file_is_named_with_what_is_wrong(tmp_path, monkeypatch, capsys):
    """A checkpoint cut anywhere is 'truncated or corrupt' (torch 2.13 reads some cuts to an
    OSError, once shown as 'cannot be read (Invalid argument)'); one the manifest lists is named
    too, not 'export 100 bytes, ...'."""
    import torch

    monkeypatch.chdir(tmp_path)
    torch.save({"model": {"w": torch.zeros(250_000)}}, "whole.pt")  # about 1 MB
    size = (tmp_path / "whole.pt").stat().st_size
    for cut in (100, 5_000, 50_000, size // 2):
        shutil.copy("whole.pt", "cut.pt")
        os.truncate("cut.pt", cut)
        assert cli.main(["export", "cut.pt", "--out", "out.pt"]) == 2
        assert capsys.readouterr().err == (f"multigpu: error: export cut.pt: truncated or corrupt "
                                           f"({cut} bytes): torch cannot find the end of its archive\n")

    assert cli.main(["train", "--model", "linear", "--data", "synthetic:48", "--batch-size", "16",
                     "--epochs", "1", "--devices", "cpu:1", "--image-size", "8", "--logger",
                     "none", "--out", "run"]) == 0
    (step,) = (tmp_path / "run" / "checkpoints").glob("step-*.pt")
    whole = step.stat().st_size
    os.truncate(step, 100)  # truncate -s 100: best.pt and last.pt are the same file
    capsys.readouterr()
    given = f"run/checkpoints/{step.name}"
    assert cli.main(["export", given, "--out", "out.pt"]) == 2
    assert capsys.readouterr().err == (f"multigpu: error: export {given}: 100 bytes, the manifest "
                                       f"says {whole}: truncated or overwritten\n")
    assert not (tmp_path / "out.pt").exists()
