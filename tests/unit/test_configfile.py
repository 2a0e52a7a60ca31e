"""`multigpu train --config FILE`, config.json's provenance and `multigpu --version`."""
import json
import subprocess
import sys
from importlib import metadata

import pytest
import torch

from multigpu import cli
from multigpu.train.settings.config import TrainConfig, config_from_args, flatten


def parse(*argv):
    return cli.build_parser().parse_args(["train", *map(str, argv)])


def fail(capsys, *argv) -> str:
    """The one error line of a bad --config; nothing reaches a run folder."""
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    return err.strip()


def test_yaml_takes_both_spellings_and_the_command_line_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: cnn\nbatch-size: 32\nweight_decay: 0.01\nlr: 1e-4\ncompile: true\n"
                    "drop-last: true\nepochs: 7\ndevices: 4\nmax-restarts: 2\n")
    args = parse("--config", path, "--epochs", "3")
    cfg = config_from_args(args)
    assert (cfg.model, cfg.input.batch_size, cfg.optim.weight_decay, cfg.optim.lr) == ("cnn", 32, 0.01, 1e-4)
    assert (cfg.compile, cfg.input.drop_last, cfg.epochs, cfg.devices) == ("default", True, 3, "4")
    assert args.max_restarts == 2  # launch flags too
    # the order does not matter: a flag before --config wins as well
    assert config_from_args(parse("--epochs", "3", "--model", "mlp", f"--config={path}")).model == "mlp"


def test_unknown_key_names_the_closest_valid_one_and_the_file(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model: mlp\nbatch_sise: 32\n")
    assert fail(capsys, "--config", path) == (
        f"multigpu: error: --config {path}: unknown setting 'batch_sise'; did you mean 'batch_size'?")


@pytest.mark.parametrize("line,message", [
    ("epochs: three", "epochs: 'three' is not an integer (as --epochs)"),
    ("epochs: 2.5", "epochs: 2.5 is not an integer (as --epochs)"),
    ("epochs: 1e400", "epochs: '1e400' is not an integer (as --epochs)"),
    ("drop_last: 1", "drop_last: 1 is not true or false (as --drop-last)"),
    ("optimizer: lamb", "optimizer: 'lamb' is not one of sgd, adam, adamw (as --optimizer)"),
    ("epochs: null", "epochs: None is not an integer (as --epochs)"),
    ("data: [digits]", "data: ['digits'] is not text (as --data)"),
])
def test_a_value_of_the_wrong_type_is_one_line(tmp_path, capsys, line, message):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: mlp\n{line}\n")
    assert fail(capsys, "--config", path) == f"multigpu: error: --config {path}: {message}"


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    (b"", "is empty"),
    (b"- model\n- mlp\n", "holds a list, not a mapping"),
    (b"model: [mlp\n", "is not valid YAML or JSON"),
    (b"\xff\xfemodel", "is not UTF-8 text"),
])
def test_a_missing_or_broken_file_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "run.yaml"
    if content is not None:
        path.write_bytes(content)
    assert message in fail(capsys, "--config", path)


def test_a_bom_and_crlf_line_endings_read_correctly(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xef\xbb\xbfmodel: mlp\r\ndata: synthetic:64\r\nbatch-size: 8\r\n")
    cfg = config_from_args(parse("--config", path))
    assert (cfg.model, cfg.input.data, cfg.input.batch_size) == ("mlp", "synthetic:64", 8)


def test_json_with_tabs_reads_too(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{\n\t"model": "mlp",\n\t"epochs": 2\n}\n')  # YAML refuses tab indentation
    assert config_from_args(parse("--config", path)).epochs == 2


def git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def test_config_json_repeats_the_run_with_its_provenance(tmp_path, monkeypatch):
    """A run's config.json given back to --config resolves to the same config, in a new folder;
    it records the real lr, workers and image size (and the run's whole plan), the command,
    versions and the git commit."""
    monkeypatch.chdir(tmp_path)
    git(tmp_path, "init", "-q")
    (tmp_path / "train.txt").write_text("the user's code\n")
    git(tmp_path, "add", "train.txt")
    git(tmp_path, "commit", "-qm", "first")
    (tmp_path / "run.yaml").write_text("model: cnn\ndata: synthetic:48\nbatch-size: 16\nepochs: 1\n"
                                       "devices: cpu:1\nimage-size: 8\n")
    assert cli.main(["train", "--config", "run.yaml", "--optimizer", "sgd", "--out", "runs/a"]) == 0
    first = json.loads((tmp_path / "runs/a/config.json").read_text())
    assert cli.main(["train", "--config", "runs/a/config.json"]) == 0
    (second_folder,) = [p for p in (tmp_path / "runs").iterdir() if p.name != "a"]
    second = json.loads((second_folder / "config.json").read_text())

    assert (first["lr"], first["image_size"]) == (0.05, 8)  # as resolved, not null
    assert first["workers"] >= 1  # synthetic data: the CPU cores per process, here
    # what the run worked out, once (train/plan.py), as one block; --config skips it
    assert first["plan"] == {"image_size": 8, "workers": first["workers"], "lr": 0.05, "batch_size": 16,
                             "accumulate": 1, "global_batch": 16, "compile": None, "decode": None,
                             "cpu_placement": None}
    assert (first["precision"], first["strategy"]) == ("fp32", "single")
    saved = {k: v for k, v in first.items() if k not in ("out", "provenance")}
    assert {k: v for k, v in second.items() if k not in ("out", "provenance")} == saved
    assert second["out"] != first["out"]

    facts = first["provenance"]
    assert facts["command"] == "multigpu train --config run.yaml --optimizer sgd --out runs/a"
    assert facts["torch"] == torch.__version__ and facts["cwd"] == str(tmp_path)
    assert facts["git"] == {"commit": git(tmp_path, "rev-parse", "HEAD"), "dirty": False}
    assert facts["gpus"] == [] and facts["hostname"] and facts["started"].startswith("20")
    assert second["provenance"]["command"] == "multigpu train --config runs/a/config.json"
    state = torch.load(tmp_path / "runs/a/checkpoints/last.pt", weights_only=True)
    assert state["config"] == first  # the checkpoint holds the same config


def test_outside_a_git_repository_there_is_no_git_key(tmp_path, monkeypatch):
    from multigpu.train.rundir import provenance

    assert provenance.git_state(str(tmp_path)) is None
    assert "git" not in provenance.launch_facts(["multigpu", "train"], str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no git installed at all
    assert provenance.git_state(str(tmp_path)) is None


def test_a_run_config_with_out_and_resume_says_they_are_dropped(tmp_path, capsys):
    path = tmp_path / "config.json"
    config = {"model": "mlp", "out": "runs/old", "resume": "runs/old", "world_size": 2,
              "global_batch": 8, "train_size": 64, "val_size": 16, "task": "classification",
              "provenance": {"command": "multigpu train"}, "lr": None}
    path.write_text(json.dumps(config))
    cfg = config_from_args(parse("--config", path))
    assert (cfg.out, cfg.checkpointing.resume, cfg.model) == (None, None, "mlp")
    assert "its out and resume are not used" in capsys.readouterr().out
    # the same keys in a file of settings are flags, and a fact that is not one is unknown
    path.write_text("model: mlp\nout: runs/new\nworld_size: 2\n")
    assert "unknown setting 'world_size'" in fail(capsys, "--config", path)


def test_every_trainconfig_field_is_a_valid_key(tmp_path):
    cfg = TrainConfig.from_flat(model="mlp", lr=0.1, compile="max-autotune", image_size=64, workers=2)
    path = tmp_path / "all.json"
    path.write_text(json.dumps(flatten(cfg)))
    assert config_from_args(parse("--config", path)) == cfg


def test_version_prints_ours_and_torchs():
    code = ("import sys; from multigpu.cli import main\n"
            "try: main(['--version'])\nexcept SystemExit: pass\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"multigpu {metadata.version('multigpu')} (torch {metadata.version('torch')}, ")
