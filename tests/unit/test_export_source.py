"""`multigpu export` / `--resume` of a folder that gives no checkpoint: the line says why."""
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
