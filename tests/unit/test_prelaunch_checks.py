"""Mistakes the launcher can find cheaply are said before any process starts (issue 40, item 5;
each was said by every rank 7-15 s in before): an empty class folder, a state dict that does not
fit the model, fewer samples than one step's devices, a script Python cannot parse."""
import pytest
import torch

LAUNCHED = "rank 0 shown here"  # the launcher's line when it starts the processes


def said(capsys) -> str:
    err = capsys.readouterr().err
    assert LAUNCHED not in err
    return err.strip().splitlines()[-1]


def folder(root, empty_class=True):
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            if not (empty_class and split == "train" and cls == "b"):
                Image.new("RGB", (12, 12)).save(root / split / cls / "0.png")


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_an_empty_class_folder(here, capsys):
    from multigpu import cli

    folder(here / "imgs")
    assert cli.main(["train", "--model", "cnn", "--data", "folder:imgs", "--image-size", "8",
                     "--devices", "cpu:2", "--out", "run"]) == 2
    assert said(capsys) == ("multigpu: error: class folder 'imgs/train/b' has no images: add "
                            ".jpg/.png files to it or remove the folder")
    assert not (here / "run").exists()


def test_a_state_dict_that_does_not_fit_the_model(here, capsys):
    from multigpu import cli

    torch.save({"0.weight": torch.zeros(5, 5)}, here / "w.pt")
    assert cli.main(["train", "--model", "mlp", "--data", "digits", "--devices", "cpu:2",
                     "--resume", "w.pt", "--out", "run"]) == 2
    assert said(capsys) == (
        "multigpu: error: --resume w.pt: its weights do not fit --model mlp on digits (missing "
        "1.weight, 1.bias, 3.weight and 3 more; unexpected 0.weight); give the --model (and "
        "--data) they were saved from, or another file")
    assert not (here / "run").exists()


def test_fewer_samples_than_devices(here, capsys):
    from multigpu import cli

    assert cli.main(["train", "--model", "mlp", "--data", "synthetic:3", "--devices", "cpu:4",
                     "--out", "run"]) == 2
    assert said(capsys) == (
        "multigpu: error: the dataset has 3 samples, fewer than the 4 that one step needs so "
        "every device gets at least one; use fewer devices or more data")
    assert not (here / "run").exists()


@pytest.mark.parametrize("auto", [[], ["--auto"]], ids=["plain", "auto"])
def test_a_script_python_cannot_parse(here, capsys, auto):
    from multigpu import cli

    (here / "bad.py").write_text("import torch\ndef f(:\n")
    assert cli.main(["run", *auto, "--devices", "cpu:2", "bad.py"]) == 2
    assert said(capsys) == (
        "multigpu: error: bad.py:2: Python cannot parse it (invalid syntax): fix this line (a "
        "Python 2 script needs porting); no process was started")
