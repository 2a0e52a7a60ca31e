"""--strategy fsdp (FSDP2) on CPU processes (gloo), through the real launcher: the same weights as
ddp, checkpoints that move between strategies and process counts unchanged, an optimizer built on
the replaced parameters refused, and `multigpu train` resuming inside an epoch on 3 processes."""
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from multigpu.train.checkpoints.checkpoint_store import CheckpointStore

from .conftest import multigpu, read_metrics

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "lib_scripts" / "fsdp_train.py"
# fsdp reduces each shard's gradient and clips with the norm of the shards' norms: the sums run
# in another order than ddp's, so the weights agree to float32 rounding, not bit for bit.
TOLERANCE = dict(rel=1e-5, abs=1e-6)


def train(tmp_path, devices, strategy, epochs, name, *extra):
    out = tmp_path / f"{name}.pt"
    proc = multigpu("run", "--devices", devices, "--log-dir", tmp_path / f"logs-{name}", SCRIPT,
                    strategy, epochs, out, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True), json.loads(proc.stdout.strip().splitlines()[-1])


def leaves(state: dict, prefix="") -> dict:
    """Every value of a checkpoint's model and optimizer parts, by path."""
    out = {}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for key, value in items:
        if isinstance(value, (dict, list, tuple)):
            out.update(leaves(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def assert_close(a: dict, b: dict, exact: bool):
    a, b = leaves({"model": a["model"], "optimizer": a["optimizer"]}), \
        leaves({"model": b["model"], "optimizer": b["optimizer"]})
    assert a.keys() == b.keys()
    for key in a:
        if not isinstance(a[key], torch.Tensor):
            assert a[key] == b[key], key
        elif exact:
            assert torch.equal(a[key], b[key]), key
        else:
            assert torch.allclose(a[key], b[key], rtol=TOLERANCE["rel"], atol=TOLERANCE["abs"]), key


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 epochs of the same model on 2 processes under ddp and under fsdp."""
    tmp = tmp_path_factory.mktemp("fsdp")
    ddp, _ = train(tmp, "cpu:2", "ddp", 2, "ddp")
    fsdp, info = train(tmp, "cpu:2", "fsdp", 2, "fsdp")
    return tmp, ddp, fsdp, info


@pytest.mark.smoke
def test_fsdp_shards_the_blocks_and_ends_with_the_weights_of_ddp(trained):
    _, ddp, fsdp, info = trained
    assert info["units"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert info["strategy"] == "fsdp (2 processes, gloo, 4 shard units)"
    assert fsdp["strategy"] == "fsdp" and fsdp["world_size"] == 2
    assert int(fsdp["optimizer"]["state"][0]["step"]) == 12  # 44 samples, 8 a step: 6 steps an epoch
    assert_close(ddp, fsdp, exact=False)


@pytest.mark.parametrize("devices", [pytest.param("cpu:1", marks=pytest.mark.extended), "cpu:3"])
def test_an_fsdp_checkpoint_loads_unchanged_on_another_process_count(trained, tmp_path, devices):
    # loaded, then saved again without a step: the whole model and optimizer state come back
    # bit for bit, sharded over 3 processes or in one
    folder, _, fsdp, _ = trained
    again, _ = train(tmp_path, devices, "fsdp", 0, "again", "--resume", folder / "fsdp.pt")
    assert_close(fsdp, again, exact=True)


@pytest.fixture(scope="module")
def sharded(trained):
    """The fsdp run's weights saved again with rt.save(sharded=True), and exported to one file."""
    folder = trained[0]
    state, _ = train(folder, "cpu:2", "fsdp", 0, "sharded", "--resume", folder / "fsdp.pt",
                     "--sharded-save")
    assert state["model"] is None and set(state["shards"]["files"]) == {
        ".metadata", "__0_0.distcp", "__1_0.distcp"}
    proc = multigpu("export", folder / "sharded.pt", "--out", folder / "sharded-whole.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder / "sharded.pt", torch.load(folder / "sharded-whole.pt", weights_only=True)


@pytest.mark.parametrize("devices, strategy", [
    ("cpu:3", "fsdp"), pytest.param("cpu:2", "ddp", marks=pytest.mark.extended),
    pytest.param("cpu:1", "single", marks=pytest.mark.extended)])
def test_a_sharded_checkpoint_loads_bit_for_bit_under_any_strategy_and_count(
        trained, sharded, tmp_path, devices, strategy):
    path, whole = sharded
    assert_close(trained[2], whole, exact=True)  # export = what was sharded
    again, _ = train(tmp_path, devices, strategy, 0, "again", "--resume", path)
    assert_close(whole, again, exact=True)


@pytest.mark.extended
def test_saving_sharded_again_at_a_path_removes_the_old_folder_unless_a_copy_names_it(
        trained, sharded, tmp_path):
    path, _ = sharded
    out = tmp_path / "s.pt"
    names = []
    for attempt in range(3):
        proc = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path / f"logs{attempt}",
                        SCRIPT, "fsdp", 0, out, "--resume", path, "--sharded-save")
        assert proc.returncode == 0, proc.stderr[-3000:]
        names.append(torch.load(out, weights_only=True)["shards"]["dir"])
        if attempt == 0:
            shutil.copyfile(out, tmp_path / "best.pt")  # a copy names the first folder too
    assert len(set(names)) == 3
    assert sorted(p.name for p in tmp_path.glob("*.shards")) == sorted([names[0], names[2]])


def test_a_ddp_checkpoint_loads_under_fsdp_and_an_fsdp_one_into_a_bare_module(trained, tmp_path):
    folder, ddp, fsdp, _ = trained
    again, _ = train(tmp_path, "cpu:3", "fsdp", 0, "from-ddp", "--resume", folder / "ddp.pt")
    assert_close(ddp, again, exact=True)
    spec = importlib.util.spec_from_file_location("fsdp_net", SCRIPT.parent / "fsdp_net.py")
    net = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(net)
    bare = net.Net()
    bare.load_state_dict(fsdp["model"])  # strict: every key, no prefix
    assert torch.equal(bare.head.weight, fsdp["model"]["head.weight"])


@pytest.mark.extended
def test_activation_checkpointing_recomputes_the_blocks_to_the_same_weights(trained, tmp_path):
    _, _, fsdp, stored = trained
    recomputed, info = train(tmp_path, "cpu:2", "fsdp", 2, "recompute", "--recompute")
    assert info["strategy"] == "fsdp (2 processes, gloo, 4 shard units, activation checkpointing)"
    # 3 blocks, 12 steps on rank 0: each block runs once in the forward, once more in the backward
    assert (stored["block_forwards"], info["block_forwards"]) == (36, 72)
    assert_close(fsdp, recomputed, exact=True)


@pytest.mark.parametrize("where", [pytest.param("after-model", marks=pytest.mark.extended),
                                   pytest.param("before-model", marks=pytest.mark.extended), "not-prepared"])
def test_an_optimizer_built_before_prepare_is_refused_with_the_fix(tmp_path, where):
    proc = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path / "logs", SCRIPT, "fsdp",
                    1, tmp_path / "x.pt", "--optimizer-first", where)
    assert proc.returncode == 2, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert ("the optimizer holds 16 parameter(s) that strategy 'fsdp' replaced when it prepared "
            "the model: stepping them would train nothing") in output
    assert "rt.prepare(model, lambda params: torch.optim.AdamW(params))" in output


@pytest.mark.extended
def test_fsdp_accumulates_like_ddp(tmp_path):
    ddp, _ = train(tmp_path, "cpu:2", "ddp", 1, "ddp-acc", "--accumulate", "2")
    fsdp, _ = train(tmp_path, "cpu:2", "fsdp", 1, "fsdp-acc", "--accumulate", "2")
    assert int(fsdp["optimizer"]["state"][0]["step"]) == 3  # 6 micro-steps of 8 samples, in windows of 2
    assert_close(ddp, fsdp, exact=False)


TRAIN = ["--model", "mlp", "--data", "synthetic:1200", "--epochs", "2", "--batch-size", "16",
         "--workers", "0", "--checkpoint-every", "10", "--keep", "2", "--deterministic"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`multigpu train` of the same job on 2 processes under ddp and under fsdp."""
    tmp = tmp_path_factory.mktemp("train")
    for strategy in ("ddp", "fsdp"):
        proc = multigpu("train", *TRAIN, "--devices", "cpu:2", "--strategy", strategy,
                        "--out", tmp / strategy)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


def test_train_with_fsdp_saves_shards_beside_small_step_files_and_keeps_only_what_is_listed(runs):
    folder = runs / "fsdp" / "checkpoints"
    entries = CheckpointStore(folder).entries()
    assert len(entries) == 2  # --keep 2
    named = {e.shards for e in entries} | {CheckpointStore(folder).best_entry().shards}
    assert sorted(p.name for p in folder.glob("*.shards")) == sorted(named)
    assert all(n.startswith("step-") for n in named)
    for entry in entries:
        state = torch.load(folder / entry.file, weights_only=True)
        assert state["model"] is None and state["optimizer"] is None
        assert set(state["shards"]["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert json.loads((runs / "fsdp" / "config.json").read_text())["strategy"] == "fsdp"


def test_export_makes_one_file_with_the_weights_of_ddp_and_never_replaces_one(runs, tmp_path):
    out = tmp_path / "fsdp.pt"
    proc = multigpu("export", runs / "fsdp", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{out}: the model (" in proc.stdout
    exported = torch.load(out, weights_only=True)
    ddp = torch.load(runs / "ddp" / "checkpoints" / "last.pt", weights_only=True)
    assert "shards" not in exported and exported["step"] == ddp["step"]
    assert_close(ddp, exported, exact=False)
    again = multigpu("export", runs / "fsdp", "--out", out)
    assert again.returncode == 2
    assert f"{out} already exists; multigpu does not replace your files" in again.stderr
    assert "Traceback" not in again.stderr


@pytest.mark.parametrize("devices, strategy", [("cpu:3", "fsdp"),
                                               pytest.param("cpu:2", "ddp", marks=pytest.mark.extended)])
def test_a_sharded_checkpoint_resumes_inside_an_epoch_on_3_processes_and_under_ddp(
        runs, tmp_path, devices, strategy):
    inside = [e for e in CheckpointStore(runs / "fsdp" / "checkpoints").entries()
              if e.run["position"]]
    entry = inside[-1]
    out = tmp_path / "resumed"
    proc = multigpu("train", *TRAIN, "--devices", devices, "--strategy", strategy, "--out", out,
                    "--resume", runs / "fsdp" / "checkpoints" / entry.file)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved by 2 x fsdp" in proc.stdout
    assert f"{entry.run['position']} of 1200 samples in" in proc.stdout
    # torch's loaders step the optimizer: not a bypass (3 processes on fewer cores are said)
    assert [x for x in proc.stderr.splitlines() if "warning" in x and "CPU processes on" not in x] == []
    assert [(r["epoch"], r["train_samples"]) for r in read_metrics(out)] == [(2, 1200)]


def test_a_step_saved_twice_gets_a_new_shards_folder_and_the_old_one_goes(tmp_path):
    # 1024 samples, 32 a step: the checkpoint every 16 steps falls on each epoch's last step,
    # which the end of the epoch saves again (after the scheduler's step): a new folder each
    # time, so the listed step file always names a folder written with it
    out = tmp_path / "run"
    proc = multigpu("train", "--model", "mlp", "--data", "synthetic:1024", "--epochs", "2",
                    "--batch-size", "16", "--workers", "0", "--checkpoint-every", "16", "--keep",
                    "1", "--scheduler", "step", "--step-size", "1", "--strategy", "fsdp",
                    "--devices", "cpu:2", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = CheckpointStore(out / "checkpoints")
    (entry,) = store.entries()
    assert entry.global_step == 64 and entry.run["position"] == 0  # the end-of-epoch save
    named = {entry.shards, store.best_entry().shards}
    assert sorted(p.name for p in (out / "checkpoints").glob("*.shards")) == sorted(named)
    state = torch.load(out / "checkpoints" / entry.file, weights_only=True)
    assert state["shards"]["dir"] == entry.shards


def test_resuming_with_another_model_is_refused_before_the_run_folder_changes(runs):
    config = (runs / "fsdp" / "config.json").read_text()
    for extra in (["--out", runs / "fsdp"], []):  # in place, and into a new folder
        proc = multigpu("train", "--model", "cnn", "--data", "digits", "--devices", "cpu:2",
                        "--resume", runs / "fsdp", *extra)
        assert proc.returncode == 2
        assert "its checkpoints are of --model mlp, and this run asks for --model cnn" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert (runs / "fsdp" / "config.json").read_text() == config


def test_a_truncated_shard_is_reported_and_the_checkpoint_before_it_used(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "fsdp", run)
    folder = run / "checkpoints"
    newest, before = CheckpointStore(folder).entries()[::-1]
    shard = folder / newest.shards / "__1_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    three_epochs = [("3" if a == "2" and TRAIN[i - 1] == "--epochs" else a)
                    for i, a in enumerate(TRAIN)]
    proc = multigpu("train", *three_epochs, "--devices", "cpu:2", "--strategy", "fsdp",
                    "--resume", run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"its shard {shard} has {size // 2} bytes, {size} when it was written: truncated or "
            "changed); trying the one before it") in proc.stderr
    assert f"resumed from {folder / before.file}" in proc.stdout


def test_fp16_skips_a_step_on_every_rank_when_one_rank_s_shard_holds_an_inf(tmp_path):
    proc = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path / "logs",
                    SCRIPT.parent / "fsdp_fp16_skip.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == [{"skipped": 1, "unchanged": True}] * 2


def test_a_convnet_with_channels_last_weights_shards_and_trains_as_under_ddp(tmp_path):
    script = SCRIPT.parent / "channels_last_convnet.py"
    states = {}
    for strategy in ("ddp", "fsdp"):
        proc = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path / strategy, script,
                        strategy, tmp_path / f"{strategy}.pt")
        assert proc.returncode == 0, proc.stderr[-3000:]
        states[strategy] = torch.load(tmp_path / f"{strategy}.pt", weights_only=True)["model"]
    assert states["ddp"].keys() == states["fsdp"].keys()
    for key, value in states["ddp"].items():
        assert torch.allclose(value, states["fsdp"][key], **dict(rtol=TOLERANCE["rel"], atol=TOLERANCE["abs"])), key
