"""The checkpoint schema: what is written now loads; every layout an earlier multigpu wrote still
loads, into the current one; a newer format is refused in one line that says to upgrade.

The older layouts are built here exactly as the code that wrote them built them: format 1 at an
epoch's end (last.pt and best.pt, no manifest, the run's place in epoch/step/best), and format 1
with the run's state under "run" (step files and a manifest)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu
from multigpu import cli
from multigpu.train.checkpoints import runstate
from multigpu.core.checkpoints import checkpoint
from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.train.checkpoints.checkpoint_store import CheckpointStore
from multigpu.train.rundir.folder_users import OUT_RESERVED_ENV
from multigpu.train.checkpoints.runstate import RunState

SRC = Path(__file__).resolve().parents[2] / "src"
NEWER = ("{}: checkpoint format 3 was written by a newer multigpu (this one reads format 1 to 2); "
         "upgrade multigpu (pip install -U multigpu) to read it")
# the keys of a checkpoint saved at an epoch's end by multigpu's first checkpoint format
EPOCH_END_KEYS = {"format", "model", "optimizer", "scheduler", "precision", "rng", "world_size",
                  "strategy", "epoch", "step", "best", "metrics", "config"}


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def trained(rt):
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_the_schema_imports_neither_torch_nor_another_multigpu_module():
    code = ("import sys, multigpu.core.checkpoints.checkpoint_schema; print('torch' in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('multigpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(SRC)}).stdout
    # multigpu.core: the package that holds it, a docstring
    assert out.strip() == ("False ['multigpu', 'multigpu.core', 'multigpu.core.checkpoints', "
                           "'multigpu.core.checkpoints.checkpoint_schema', 'multigpu.core.errors']")


def test_the_run_fields_are_those_runstate_saves():
    assert schema.RUN_FIELDS == tuple(RunState().summary())


def test_step_file_names_and_the_run_folder_of_a_checkpoint():
    assert schema.step_file_name(1200) == "step-000001200.pt"
    assert schema.step_of("step-000001200.pt") == 1200
    assert [schema.step_of(n) for n in ("last.pt", "step-12.pt.tmp", "step-x.pt")] == [None, None, None]
    assert schema.run_folder_of(Path("runs/a/checkpoints/last.pt")) == Path("runs/a")
    assert schema.run_folder_of(Path("elsewhere/w.pt")) == Path("elsewhere")
    assert schema.run_folder(Path("runs/a/checkpoints")) == Path("runs/a")
    assert schema.checkpoints_folder(Path("runs/a")) == Path("runs/a/checkpoints")


def test_a_checkpoint_written_now_is_of_the_current_format_and_loads(tmp_path):
    rt = multigpu.setup("single", accelerator="cpu")
    model, opt = trained(rt)
    at = RunState(epoch=3, position=40, global_step=57, loss_sum=1.5, seconds=2.0, best=0.8)
    state = rt.checkpoint_state(model, opt, **at.to_checkpoint(), metrics={"epoch": 2},
                                config={"model": "mlp"})
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    store.acquire()
    store.write(checkpoint.to_cpu(state), global_step=57, run=at.summary(), best=True)
    store.release()
    raw = torch.load(store.folder / "step-000000057.pt", weights_only=True)
    assert (raw["format"], schema.FORMAT_VERSION) == (2, 2)
    assert raw["run"] == at.summary() and (raw["epoch"], raw["step"], raw["best"]) == (2, 57, 0.8)
    assert json.loads((store.folder / "manifest.json").read_text())["format"] == 1

    point = runstate._find(tmp_path / "run", None, 3, print)
    assert point.in_place and point.run.summary() == at.summary() and len(point.run.rng) == 1
    fresh = small_model(seed=1)
    rt.load(point.state, model=fresh)
    assert same_weights(fresh, model)
    rt.save(tmp_path / "ck.pt", model=model, optimizer=opt, epoch=7)  # the library's own file
    assert torch.load(tmp_path / "ck.pt", weights_only=True)["format"] == 2
    assert "run" not in rt.load(tmp_path / "ck.pt", model=fresh)


def epoch_end_checkpoint(rt, model, opt, epoch: int, step: int, best: float) -> dict:
    """As multigpu train saved at the end of every epoch in format 1 (Runtime._write_checkpoint
    with extra epoch/step/best/metrics/config)."""
    return {"format": 1, "model": checkpoint.to_cpu(model.state_dict()),
            "optimizer": checkpoint.to_cpu(opt.state_dict()), "scheduler": None,
            "precision": rt.precision.state_dict(), "rng": [checkpoint.rng_state()],
            "world_size": 1, "strategy": "single", "epoch": epoch, "step": step, "best": best,
            "metrics": {"epoch": epoch, "val_accuracy": best}, "config": {"model": "mlp"}}


def test_a_format_1_checkpoint_of_an_epochs_end_resumes_after_that_epoch(tmp_path):
    rt = multigpu.setup("single", accelerator="cpu")
    model, opt = trained(rt)
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(epoch_end_checkpoint(rt, model, opt, epoch=2, step=46, best=0.75), folder / "last.pt")
    (folder / "best.pt").write_bytes((folder / "last.pt").read_bytes())

    point = runstate._find(tmp_path / "run", None, 3, print)  # no manifest: last.pt, unverified
    assert point.path == str(folder / "last.pt") and point.in_place
    assert point.run.summary() == {"epoch": 3, "position": 0, "global_step": 46, "loss_sum": 0.0,
                                   "seconds": 0.0, "best": 0.75}
    assert point.state["format"] == 2 and point.state["step"] == 46
    for given in (str(tmp_path / "run"), str(folder / "best.pt")):  # --resume of its folder, a file
        state, _ = runstate.load_source(given)
        assert RunState.from_checkpoint(state).global_step == 46
    fresh = small_model(seed=1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    rt.load(point.state, model=fresh, optimizer=fresh_opt)
    assert same_weights(fresh, model)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["momentum_buffer"],
                       opt.state_dict()["state"][0]["momentum_buffer"])


def test_a_format_1_checkpoint_with_the_runs_state_resumes_mid_epoch(tmp_path):
    """As multigpu train saved before format 2: the same keys, "run" included, format 1."""
    rt = multigpu.setup("single", accelerator="cpu")
    model, opt = trained(rt)
    at = RunState(epoch=2, position=96, global_step=30, loss_sum=4.25, seconds=1.5, best=0.5)
    state = rt.checkpoint_state(model, opt, **at.to_checkpoint(), metrics=None, config={})
    state = checkpoint.to_cpu(state | {"format": 1})
    assert set(state) == EPOCH_END_KEYS | {"run"}
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    store.acquire()
    store.write(state, global_step=30, run=at.summary(), best=False)
    store.release()
    point = runstate._find(tmp_path / "run", None, 3, print)
    assert point.run.summary() == at.summary() and point.state["format"] == 2


def test_an_rt_save_file_of_format_1_loads_with_its_values():
    rt = multigpu.setup("single", accelerator="cpu")
    model, opt = trained(rt)
    old = epoch_end_checkpoint(rt, model, opt, epoch=4, step=9, best=0.1)
    got = rt.load(old, model=small_model(seed=1))
    assert (got["epoch"], got["step"], got["format"], old["format"]) == (4, 9, 2, 1)  # old: as given
    assert RunState.from_checkpoint(got).epoch == 5


def test_an_epoch_end_run_folder_of_format_1_trains_on_with_multigpu_train(tmp_path, monkeypatch,
                                                                           capsys):
    """The whole path: a run's checkpoint put back into the first layout (last.pt alone), then
    `multigpu train --resume RUN` goes on after its epoch."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(OUT_RESERVED_ENV, "")
    args = ["train", "--model", "cnn", "--data", "synthetic:48", "--batch-size", "16",
            "--image-size", "8", "--devices", "cpu:1", "--workers", "0"]
    assert cli.main([*args, "--epochs", "1", "--out", "run"]) == 0
    folder = tmp_path / "run" / "checkpoints"
    new = torch.load(folder / "last.pt", weights_only=True)
    old = {k: v for k, v in new.items() if k not in ("run", "decode")} | {"format": 1}
    assert set(old) == EPOCH_END_KEYS and old["epoch"] == 1
    for p in folder.iterdir():
        p.unlink()
    torch.save(old, folder / "last.pt")
    capsys.readouterr()

    assert cli.main([*args, "--epochs", "2", "--resume", "run"]) == 0
    said = capsys.readouterr()
    assert f"resumed from {Path('run/checkpoints/last.pt')} (after epoch 1, step {old['step']}; " \
           "saved by 1 x single)" in said.out + said.err
    after = torch.load(folder / "last.pt", weights_only=True)
    assert after["format"] == 2
    assert (after["run"]["epoch"], after["run"]["global_step"]) == (3, 2 * old["step"])
    assert [r["epoch"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())] == [1, 2]


def test_a_newer_format_is_refused_in_one_line_naming_it_and_the_fix(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(OUT_RESERVED_ENV, "")
    future = {"format": 3, "model": small_model().state_dict()}
    torch.save(future, tmp_path / "future.pt")
    with pytest.raises(schema.NewerFormatError) as caught:
        checkpoint.load(tmp_path / "future.pt")
    assert str(caught.value) == NEWER.format(tmp_path / "future.pt")
    rt = multigpu.setup("single", accelerator="cpu")
    with pytest.raises(schema.NewerFormatError, match="^the checkpoint dict given to load"):
        rt.load(future, model=small_model())

    assert cli.main(["train", "--model", "mlp", "--data", "digits", "--devices", "cpu:1",
                     "--resume", "future.pt", "--out", "run"]) == 2
    assert capsys.readouterr().err == "multigpu: error: --resume " + NEWER.format("future.pt") + "\n"
    assert not (tmp_path / "run").exists()
    assert cli.main(["export", "future.pt"]) == 2
    assert capsys.readouterr().err == "multigpu: error: export " + NEWER.format("future.pt") + "\n"


def test_a_newer_checkpoint_in_a_run_folder_is_refused_not_skipped_as_damaged(tmp_path):
    """An older multigpu must not go on from the checkpoint before it, as from a damaged one."""
    store = CheckpointStore(tmp_path / "checkpoints")
    store.acquire()
    store.write({"format": 2, "model": {}}, global_step=1, run={}, best=False)
    store.write({"format": 3, "model": {}}, global_step=2, run={}, best=False)
    warned = []
    with pytest.raises(schema.NewerFormatError, match="checkpoint format 3 was written by a newer"):
        store.load_newest(warned.append)
    assert warned == []

    manifest = json.loads((store.folder / "manifest.json").read_text())
    (store.folder / "manifest.json").write_text(json.dumps(manifest | {"format": 2}))
    with pytest.raises(schema.NewerFormatError) as caught:
        store.entries()
    assert str(caught.value) == (f"{store.folder / 'manifest.json'}: manifest format 2 was written "
                                 "by a newer multigpu (this one reads format 1); upgrade multigpu "
                                 "(pip install -U multigpu) to read it")
    store.release()


def test_a_format_multigpu_never_wrote_is_damage_and_the_one_before_is_used(tmp_path):
    store = CheckpointStore(tmp_path / "checkpoints")
    store.acquire()
    store.write({"format": 2, "model": {}, "step": 1}, global_step=1, run={}, best=False)
    store.write({"format": "2", "model": {}}, global_step=2, run={}, best=False)
    warned = []
    state, path = store.load_newest(warned.append)
    assert (state["step"], path.name) == (1, "step-000000001.pt")
    assert warned == [f"checkpoint {store.folder / 'step-000000002.pt'} is damaged "
                      f"({store.folder / 'step-000000002.pt'}: checkpoint format '2' is not one "
                      "multigpu wrote (it reads format 1 to 2): damaged, or not multigpu's); "
                      "trying the one before it"]
    store.release()
