"""`--resume` of a file that is not a multigpu checkpoint: a model's bare state dict (what a user
converting their own script has), in either torch.save format and with the prefixes of
DataParallel/DDP and torch.compile, starts the run from its weights; one that does not fit the
model, or a legacy pickle of a whole module, is refused in one line, leaving no run folder."""
import pytest
import torch

from multigpu.train.models.catalog import build_model

from .conftest import multigpu

pytestmark = pytest.mark.slow

# --lr 1e-30: every update is far below the last bit of the weights, so the run's checkpoint
# holds exactly the weights it started from, while it still trains its epoch through.
COMMON = ["train", "--model", "mlp", "--data", "digits", "--epochs", "1", "--batch-size", "64",
          "--workers", "0", "--lr", "1e-30"]
SAYS = ("--resume {} holds weights only ({}): training starts from them at epoch 1 with a fresh "
        "optimizer")


def mlp_weights(classes: int = 10) -> dict:
    """Weights of --model mlp on digits, none near 0 and none a fresh model would have."""
    torch.manual_seed(123)
    model = build_model("mlp", (1, 8, 8), classes)
    return {k: torch.randn_like(v).sign() * (0.05 + 0.05 * torch.rand_like(v))
            for k, v in model.state_dict().items()}


@pytest.mark.parametrize("prefix,legacy,wrapped", [
    ("module.", False, None), ("_orig_mod.", True, None), ("", False, "state_dict")],
    ids=["ddp-prefix-zip", "compile-prefix-legacy", "under-key-state_dict"])
def test_a_state_dict_is_the_starting_weights(tmp_path, prefix, legacy, wrapped):
    weights = mlp_weights()
    saved = {prefix + k: v for k, v in weights.items()}
    torch.save(saved if wrapped is None else {wrapped: saved, "epoch": 7}, tmp_path / "w.pt",
               _use_new_zipfile_serialization=not legacy)
    out = tmp_path / "run"
    proc = multigpu(*COMMON, "--devices", "cpu:1", "--resume", tmp_path / "w.pt", "--out", out,
                    cwd=tmp_path)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    what = "a state dict" if wrapped is None else f"a state dict under its key '{wrapped}'"
    assert said.count(SAYS.format(tmp_path / "w.pt", what)) == 1, said[-3000:]
    assert "Traceback" not in said and "Warning" not in said
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert state["run"]["epoch"] == 2 and state["run"]["global_step"] == 23  # epoch 1, trained
    assert state["model"].keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(state["model"][key], value), key


def test_a_state_dict_that_does_not_fit_is_refused_in_one_line(tmp_path):
    torch.save(mlp_weights(classes=7), tmp_path / "w7.pt")
    proc = multigpu(*COMMON, "--devices", "cpu:2", "--resume", "w7.pt", "--out", "run",
                    cwd=tmp_path)
    said = proc.stdout + proc.stderr
    line = ("multigpu: error: --resume w7.pt: its weights do not fit --model mlp on digits "
            "(other shapes: 5.weight (7x256 in the file, 10x256 in the model), 5.bias (7 in the "
            "file, 10 in the model)); give the --model (and --data) they were saved from, or "
            "another file")
    assert proc.returncode == 2, said[-3000:]
    assert said.count(line) == 1 and said.count("error:") == 1, said[-3000:]
    assert "Traceback" not in said
    assert not (tmp_path / "run").exists(), "no run folder left by a refused start"


def test_a_legacy_pickle_of_a_whole_module_is_refused_for_what_it_holds(tmp_path):
    model = build_model("mlp", (1, 8, 8), 10)
    torch.save(model, tmp_path / "model.pt", _use_new_zipfile_serialization=False)
    proc = multigpu(*COMMON, "--devices", "cpu:1", "--resume", "model.pt", "--out", "run",
                    cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        "multigpu: error: --resume model.pt: refused: it holds torch.nn.modules.container."
        "Sequential, which unpickling could run as code; multigpu reads checkpoints with "
        "weights_only=True and never runs code from one. If you made the file and trust it, "
        "load it yourself and save its state dicts with torch.save")
    assert not (tmp_path / "run").exists()


def test_export_of_a_bare_state_dict_says_there_is_nothing_to_export(tmp_path):
    torch.save(mlp_weights(), tmp_path / "w.pt")
    done = multigpu("export", tmp_path / "w.pt", "--out", tmp_path / "x.pt")
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"multigpu: error: {tmp_path / 'w.pt'} holds weights only (a state dict), "
                           "not a checkpoint of a run: there is nothing to export; torch.load it as "
                           "it is, or train from it with multigpu train --resume\n")
    assert not (tmp_path / "x.pt").exists()
