"""`multigpu train` end to end, through the real launcher (torch.distributed.run) on CPU/gloo."""
import json
import os
import subprocess
import sys

import pytest
import torch

from multigpu.train.models.catalog import build_model

from multigpu.train.trainloop import EARLY_WORKERS_ENV

from .conftest import cli_env, multigpu, read_metrics

pytestmark = pytest.mark.slow

COMMON = ["--model", "mlp", "--data", "synthetic:205", "--epochs", "2", "--optimizer", "sgd",
          "--lr", "0.05", "--workers", "0", "--seed", "5"]


@pytest.fixture(scope="module")
def one_and_two_process_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("equal")
    # Same global batch (8) and data order: 1 process x 8, or 2 processes x 4. 205 = 25 * 8 + 5,
    # so the last step is uneven (3 + 2 samples on two ranks) and must still average exactly.
    one = multigpu("train", *COMMON, "--batch-size", "8", "--devices", "cpu:1", "--out", base / "one")
    two = multigpu("train", *COMMON, "--batch-size", "4", "--devices", "cpu:2", "--out", base / "two")
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:] + two.stdout[-3000:]
    return base / "one", base / "two", two


@pytest.mark.smoke
def test_ddp_on_two_processes_ends_with_the_same_weights_as_one(one_and_two_process_runs):
    one, two, _ = one_and_two_process_runs
    a = torch.load(one / "checkpoints" / "last.pt", weights_only=True)["model"]
    b = torch.load(two / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    ma, mb = read_metrics(one), read_metrics(two)
    assert [m["train_samples"] for m in ma] == [m["train_samples"] for m in mb] == [205, 205]
    assert ma[-1]["val_samples"] == mb[-1]["val_samples"]
    assert ma[-1]["val_accuracy"] == pytest.approx(mb[-1]["val_accuracy"])
    assert ma[-1]["val_loss"] == pytest.approx(mb[-1]["val_loss"], rel=1e-5)


@pytest.mark.smoke
def test_two_processes_say_the_devices_the_global_batch_its_lr_and_the_last_step_once(
        one_and_two_process_runs):
    _, two, proc = one_and_two_process_runs
    said = proc.stdout + proc.stderr
    # the launcher's header, with where the ranks' output goes (train's own line said it again)
    assert [line for line in said.splitlines() if "2 CPU processes (gloo)" in line] == [
        f"multigpu: 2 CPU processes (gloo); rank 0 shown here, the other ranks logged in {two}/logs"]
    lr = ("global batch 8 (4 per device x 2 devices): --lr 0.05 is used as given, not scaled, so "
          "an epoch makes 2x fewer optimizer steps than at batch 4 on one device; if accuracy lags "
          "the one-device run, try --lr 0.1 (linear scaling: --lr x 2) or more --epochs")
    last = ("last step: 205 training samples, 4 per device x 2 devices = 8 per step: 26 steps; "
            "the last has 5 (3+2 per process)")
    assert said.count(lr) == 1 and said.count(last) == 1, said[-3000:]
    rank1 = "".join(p.read_text() for p in two.glob("logs/*/attempt_0/1/std*.log"))
    assert "global batch 8 (" not in rank1 and "last step" not in rank1  # rank 0 says it
    assert "warning" not in proc.stderr  # the normal path: no guard fires


@pytest.mark.smoke
def test_run_folder_holds_config_metrics_and_checkpoints(one_and_two_process_runs):
    _, two, proc = one_and_two_process_runs
    config = json.loads((two / "config.json").read_text())
    assert (config["world_size"], config["strategy"], config["global_batch"]) == (2, "ddp", 8)
    record = read_metrics(two)[-1]
    for key in ("epoch", "train_loss", "train_samples", "val_loss", "val_accuracy", "val_samples",
                "epoch_seconds", "samples_per_second"):
        assert key in record
    assert (two / "checkpoints" / "best.pt").exists()
    assert proc.stdout.count("epoch 2 ") == 1, "only rank 0 prints the epoch summary"


@pytest.mark.smoke
def test_rank_0_ends_with_where_the_job_s_time_went(one_and_two_process_runs):
    import re

    _, two, proc = one_and_two_process_runs
    said = [line for line in proc.stdout.splitlines() if line.startswith("time: ")]
    assert len(said) == 1, proc.stdout[-2000:]
    parts = re.fullmatch(r"time: ([\d.]+) s since the command: ([\d.]+) s starting \((.*)\), first "
                         r"step done at ([\d.]+) s \(([\d.]+) s waiting for data\), ([\d.]+) s training, "
                         r"([\d.]+) s evaluating, ([\d.]+) s held up by checkpoints, "
                         r"(-?[\d.]+) s other \(metrics, plot\)", said[0])
    assert parts, said[0]
    _, start, starting, first, first_wait, training, _, _, other = parts.groups()
    assert float(start) <= float(first) <= float(start) + float(training) + 0.1
    assert float(first_wait) <= float(first) - float(start) + 0.1  # the wait is part of the first step's
    # DDP's constructor imports torch's compiler: a thread imported its modules while the group
    # formed, then the compiler (head_start.py)
    starting, beside = starting.split("; meanwhile in a thread: ")
    assert re.fullmatch(r"compiler's modules [\d.]+ during [a-z +]+, compiler [\d.]+ during [a-z +]+",
                        beside), beside
    names = [part.rsplit(" ", 1)[0] for part in starting.split(", ")]
    assert names == ["launcher", "workers' start", "imports", "process group", "data", "model", "prepare", "optimizer",
                     "config", "resume", "logs"]
    seconds = [float(part.rsplit(" ", 1)[1]) for part in starting.split(", ")]
    assert sum(seconds) == pytest.approx(float(start), abs=0.6)  # 11 parts, each rounded to 0.1 s
    # the launcher's import of torch (torchrun's), then the worker's, after its Python's start
    assert seconds[0] > 0.2 and seconds[2] > 0.3
    epochs = sum(r["epoch_seconds"] for r in read_metrics(two))
    assert float(training) == pytest.approx(epochs, abs=0.15)
    assert float(other) >= 0  # the parts, each timed on its own, add up to no more than the whole


@pytest.mark.smoke
def test_rank_0_says_the_estimate_after_its_first_timed_steps_and_compares_it_at_the_end(
        one_and_two_process_runs):
    import re

    _, two, proc = one_and_two_process_runs
    said = [line for line in proc.stdout.splitlines() if line.startswith("estimate: ")]
    assert len(said) == 2, proc.stdout[-3000:]
    first = re.fullmatch(r"estimate: ~(.+) an epoch of 26 steps \(training (.+), evaluation (.+), "
                         r"checkpoint (.+)\), ~(.+) for 2 epochs, under 0.01 CPU-hours on 2 CPU "
                         r"processes \(from 20 measured steps, ±\d+ %\); not in it: start-up, a "
                         r"first epoch's compile \(--compile\)", said[0])
    assert first, said[0]
    epoch, training, evaluation, checkpoint, total = (float(t.split()[0]) for t in first.groups())  # in s
    assert epoch == pytest.approx(training + evaluation + checkpoint, rel=0.01)  # 3 figures each
    assert total == pytest.approx(2 * epoch, rel=0.01)
    assert evaluation > 0 and checkpoint > 0  # both timed on rank 0, not guessed
    # 5 batches skipped, 20 timed up to the last but one: before the first epoch's line
    lines = proc.stdout.splitlines()
    assert lines.index(said[0]) < next(i for i, line in enumerate(lines) if line.startswith("epoch 1 "))
    closing = re.fullmatch(r"estimate: the 2 epochs took ([\d.]+) s, estimated ~([\d.]+) s \((.+)\)", said[1])
    assert closing and float(closing.group(2)) == total, said[1]
    real = float(closing.group(1))
    assert real >= sum(r["epoch_seconds"] for r in read_metrics(two)) - 0.01  # evaluation and more too
    if real < 5:  # a run this short is not compared: its start and end outweigh its steps
        assert closing.group(3) == "under 5 s: too short a run to compare", said[1]
    else:  # a loaded machine: the percentage, of times said to 3 figures
        off = re.fullmatch(r"(\d+) % (longer|shorter) than estimated", closing.group(3))
        assert off and int(off.group(1)) == pytest.approx(abs(real - total) / total * 100, abs=2), said[1]
    assert lines.index(said[1]) == next(i for i, line in enumerate(lines) if line.startswith("time: ")) - 1


def test_two_process_checkpoint_loads_into_a_bare_model(one_and_two_process_runs):
    _, two, _ = one_and_two_process_runs
    state = torch.load(two / "checkpoints" / "last.pt", weights_only=True)
    model = build_model("mlp", (32,), 10)
    model.load_state_dict(state["model"])  # strict: no `module.` prefix, nothing missing
    # the same weights as hand-written DDP code saves them (`module.` keys), into a fresh model
    import multigpu
    fresh = build_model("mlp", (32,), 10)
    multigpu.load_model_state(fresh, {"module." + k: v for k, v in state["model"].items()})
    assert fresh.state_dict().keys() == state["model"].keys()
    different = [k for k, v in fresh.state_dict().items() if not torch.equal(v, state["model"][k])]
    assert not different, different


def test_load_model_gives_back_the_trained_model_of_a_run_or_a_checkpoint(one_and_two_process_runs, tmp_path):
    import multigpu
    from multigpu.core.errors import UsageError

    _, two, _ = one_and_two_process_runs
    state = torch.load(two / "checkpoints" / "last.pt", weights_only=True)
    for source in (two, two / "checkpoints" / "last.pt"):
        model = multigpu.load_model(source)
        assert not model.training
        assert model.state_dict().keys() == state["model"].keys()
        assert all(torch.equal(v, state["model"][k]) for k, v in model.state_dict().items())
    torch.save(state["model"], tmp_path / "weights.pt")  # weights alone: nothing says the model
    with pytest.raises(UsageError, match="does not say how its model was built"):
        multigpu.load_model(tmp_path / "weights.pt")


def test_more_cpu_processes_than_cores_are_said_before_the_launch_of_train_and_run(tmp_path):
    import subprocess
    import sys

    from .conftest import cli_env

    # on one core (the CPUs this process may use), 2 CPU processes
    r = subprocess.run([sys.executable, "-m", "multigpu", "train", "--model", "linear", "--data",
                        "synthetic:64", "--epochs", "1", "--devices", "cpu:2", "--out", tmp_path / "r"],
                       env=cli_env(), capture_output=True, text=True, timeout=240,
                       preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert r.returncode == 0, r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if "CPU processes on" in line]
    assert said == ["multigpu: warning: 2 CPU processes on 1 core: they take turns, each slower "
                    "than one process alone; use --devices cpu:1 or fewer"], r.stderr[-3000:]
    # multigpu run says it too, before it starts the script
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    r = subprocess.run([sys.executable, "-m", "multigpu", "run", "--devices", "cpu:2", script],
                       env=cli_env(), capture_output=True, text=True, timeout=240,
                       preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.splitlines()[0] == said[0], r.stderr[-3000:]


def test_posts_case_8607_samples_batch_4_on_4_processes(tmp_path):
    out = tmp_path / "posts"
    proc = multigpu("train", "--model", "linear", "--data", "synthetic:8607", "--batch-size", "4",
                    "--devices", "cpu:4", "--epochs", "1", "--workers", "0", "--out", out, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = read_metrics(out)[0]
    config = json.loads((out / "config.json").read_text())
    assert record["train_samples"] == 8607
    assert record["val_samples"] == config["val_size"]
    assert ("last step: 8607 training samples, 4 per device x 4 devices = 16 per step: 538 steps; "
            "the last has 15 (4+4+4+3 per process)") in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--model", "resnet19"], "unknown model 'resnet19'"),
    (["--model", "mlp", "--data", "folder:/no/such/dir"],
     "multigpu: error: data folder '/no/such/dir' does not exist: check the path in "
     "--data folder:/no/such/dir"),
    # the rest of the line says what this machine has (no GPU here, fewer than 10 on a GPU machine)
    (["--model", "mlp", "--devices", "0,9"], "multigpu: error: --devices 0,9: "),
    (["--model", "mlp", "--epochs", "0"], "--epochs 0 must be a number at least 1, e.g. --epochs 1"),
    (["--model", "cnn", "--compile", "reduce-overhead", "--devices", "cpu:2"],
     "--compile reduce-overhead records CUDA graphs, which need GPUs; on cpu use --compile default"),
    (["--model", "cnn", "--compile", "reduce-overhead", "--strategy", "dp"],
     "DataParallel drives all GPUs from one process: use --strategy ddp"),
    (["--model", "cnn", "--compile", "reduce-overhead", "--accumulate", "2", "--devices", "cpu:2"],
     "--accumulate 2 adds up; use --accumulate 1 with a larger --batch-size, or --compile default"),
])
@pytest.mark.smoke
def test_bad_arguments_give_one_line_and_exit_2(tmp_path, args, message):
    proc = multigpu("train", *args, "--out", tmp_path / "x")
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not (tmp_path / "x").exists(), "refused before the run folder is made"


@pytest.mark.smoke
def test_existing_run_folder_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = multigpu("train", "--model", "linear", "--out", out)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert (out / "notes.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


def test_resuming_a_finished_run_says_it_is_complete_and_trains_nothing(one_and_two_process_runs, tmp_path):
    one, _, _ = one_and_two_process_runs
    proc = multigpu("train", *COMMON, "--batch-size", "8", "--devices", "cpu:1", "--resume", one,
                    "--out", tmp_path / "again")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("the run is complete (2 of 2 epochs): nothing left to train; a larger --epochs trains "
            "on from here") in proc.stdout
    assert not (tmp_path / "again" / "metrics.jsonl").exists() and "epoch 1 " not in proc.stdout


@pytest.mark.smoke
def test_resume_a_two_process_checkpoint_in_one_process_continues_exactly(one_and_two_process_runs, tmp_path):
    # Epochs 1-2 on 2 processes, epoch 3 resumed in 1 process == 3 epochs in 1 process.
    _, two, _ = one_and_two_process_runs
    straight = multigpu("train", *COMMON[:4], "--epochs", "3", *COMMON[6:], "--batch-size", "8",
                        "--devices", "cpu:1", "--out", tmp_path / "straight")
    resumed = multigpu("train", *COMMON[:4], "--epochs", "3", *COMMON[6:], "--batch-size", "8",
                       "--devices", "cpu:1", "--resume", two, "--out", tmp_path / "resumed")
    assert straight.returncode == 0 and resumed.returncode == 0, resumed.stderr[-3000:]
    (line,) = [x for x in resumed.stdout.splitlines() if x.startswith("resumed from")]
    assert "global batch" not in line  # 2 x 4 then, 1 x 8 now
    assert [m["epoch"] for m in read_metrics(tmp_path / "resumed")] == [3]
    a = torch.load(tmp_path / "straight" / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "checkpoints" / "last.pt", weights_only=True)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (3, 78)
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=1e-5, atol=1e-6)


@pytest.mark.extended  # a second test of its change; the default tier keeps the first
def test_a_resume_on_another_device_count_says_the_global_batch_it_changed(one_and_two_process_runs, tmp_path):
    _, two, _ = one_and_two_process_runs  # 2 processes x 4 = 8
    resumed = multigpu("train", *COMMON[:4], "--epochs", "3", *COMMON[6:], "--batch-size", "4",
                       "--devices", "cpu:1", "--resume", two, "--out", tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (line,) = [x for x in resumed.stdout.splitlines() if x.startswith("resumed from")]
    assert line.endswith("saved by 2 x ddp); the global batch is 4 now (4 per device), 8 when it "
                         "was saved: --batch-size is per device, so the device count changes it, "
                         "and --lr is kept as given"), line


def test_resume_of_a_missing_checkpoint_is_one_line(tmp_path):
    proc = multigpu("train", "--model", "mlp", "--resume", tmp_path / "nothing", cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (f"multigpu: error: --resume {tmp_path / 'nothing'}: no checkpoint there "
                           "(no such file or folder); give a checkpoint file or a run folder\n")
    assert list(tmp_path.iterdir()) == [], "refused before a run folder is made under runs/"


def test_validation_on_two_processes_evaluates_the_saved_model(tmp_path):
    """BatchNorm statistics differ per rank during training (not copied every step); before the
    evaluation every rank takes rank 0's, so the metrics are those of the checkpoint."""
    from multigpu import setup
    from multigpu.train import engine, training
    from multigpu.train.settings.config import FLAT_NAMES, TrainConfig

    out = tmp_path / "bn"
    proc = multigpu("train", "--model", "cnn", "--data", "digits", "--epochs", "1",
                    "--batch-size", "16", "--workers", "0", "--devices", "cpu:2", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((out / "config.json").read_text())
    cfg = TrainConfig.from_flat(**{k: v for k, v in saved.items() if k in FLAT_NAMES}
                                | {"strategy": "single"})
    rt = setup("single", cfg.numerics.precision, accelerator="cpu", seed=cfg.seed)
    job = training.build_job(cfg, rt)
    rt.load(out / "checkpoints" / "last.pt", model=job.model)
    alone = engine.evaluate(rt, job.model, job.loss_fn, job.val_loader, True, job.settings)
    logged = read_metrics(out)[-1]
    assert alone["val_samples"] == logged["val_samples"]
    assert alone["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-5)


@pytest.mark.extended
def test_two_nodes_sharing_a_filesystem_train_into_one_folder(tmp_path):
    """Also: MULTIGPU_PROFILE_STEPS set on the node started first, not on the other: both
    ranks profile the window if global rank 0 (either node: the rendezvous numbers the ranks in
    the order the nodes join) is on the node that asked for it, neither if not; one node profiling
    alone left the other's ranks waiting for it in the profile's all-gather."""
    import socket
    import subprocess
    import sys

    from .conftest import cli_env

    with socket.socket() as s:  # test-only: a port for the two "nodes" to agree on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    common = ["--model", "linear", "--data", "synthetic:64", "--epochs", "1", "--workers", "0",
              "--devices", "cpu:1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--start-timeout", "90", "--out", str(out)]
    env = {"1": {**cli_env(), "MULTIGPU_PROFILE_STEPS": "1-1"}, "0": cli_env()}
    nodes = [subprocess.Popen([sys.executable, "-m", "multigpu", "train", *common, "--node-rank", r],
                              env=env[r], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in ("1", "0")]
    results = [n.communicate(timeout=200) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [err[-2000:] for _, err in results]
    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    assert [m["train_samples"] for m in read_metrics(out)] == [64]
    asked = "multigpu train: linear on" in results[0][0] + results[0][1]  # rank 0 on node-rank 1
    said = ["profile of steps 1-1, rank 0: " in out_ + err_ for out_, err_ in results]
    assert said == [asked, False], results
    profiled = sorted(p.name for p in (out / "profile").glob("rank*.json")) if asked else []
    assert profiled == (["rank0.json", "rank1.json"] if asked else []) and (out / "profile").exists() == asked


@pytest.mark.extended
def test_an_unreadable_image_is_skipped_counted_and_the_run_finishes(tmp_path):
    from PIL import Image

    for split, n in (("train", 12), ("val", 2)):
        for cls in ("a", "b"):
            (tmp_path / "imgs" / split / cls).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (12, 12), (20 * i, 0, 0)).save(tmp_path / "imgs" / split / cls / f"{i}.png")
    (tmp_path / "imgs" / "train" / "a" / "3.png").write_bytes(b"\x89PNG cut off")
    out = tmp_path / "run"
    proc = multigpu("train", "--model", "cnn", "--data", f"folder:{tmp_path / 'imgs'}", "--image-size", "8",
                    "--epochs", "2", "--batch-size", "4", "--workers", "2", "--devices", "cpu:2", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped unreadable image" in proc.stderr and "train/a/3.png" in proc.stderr
    assert [(m["train_samples"], m["bad_images"]) for m in read_metrics(out)] == [(24, 1), (24, 1)]
    for epoch in (1, 2):  # summed over the ranks, said on rank 0's console
        assert f"multigpu: warning: epoch {epoch}: 1 unreadable image skipped" in proc.stderr


def test_a_run_that_waits_for_its_input_is_told_so_with_the_fix(tmp_path):
    """Large noisy JPEGs (about 12 ms each to decode here) decoded in the training process
    (--workers 0) for a linear model on 8x8 crops: the step waits for the input most of the time,
    over a second an epoch."""
    import io

    import numpy as np
    from PIL import Image

    encoded = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (1024, 1024, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(encoded, format="JPEG", quality=90)
    for split, n in (("train", 100), ("val", 2)):
        for cls in ("a", "b"):
            (tmp_path / "imgs" / split / cls).mkdir(parents=True)
            for i in range(n):
                (tmp_path / "imgs" / split / cls / f"{i}.jpg").write_bytes(encoded.getvalue())
    proc = multigpu("train", "--model", "linear", "--data", f"folder:{tmp_path / 'imgs'}", "--image-size", "8",
                    "--epochs", "2", "--batch-size", "8", "--workers", "0", "--devices", "cpu:1",
                    "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert len(records) == 2 and all(r["input_wait"] > 0.5 for r in records), records
    said = [line for line in proc.stderr.splitlines() if "for the next batch" in line]
    assert len(said) == 1, said  # not for the first epoch (the workers' start)
    assert said[0].startswith("multigpu: warning: epoch 2 waited ")
    cores = len(os.sched_getaffinity(0))  # one process: all of them
    fix = (f"more --workers than 0 per process ({cores} cores each)" if cores > 1 else
           "files that cost less to read and decode (smaller images), or more CPU cores: the "
           "training process and its 0 loader workers use the 1 core of each process already")
    assert said[0].endswith(f"the input, not the training step, sets the pace; try {fix}"), said
    assert "% waiting for data" in proc.stdout


def test_a_config_file_reaches_every_worker_and_config_json_keeps_the_typed_command(tmp_path):
    """Workers are relaunched with the merged flags (not the file); config.json keeps the
    command the user typed, not the workers'."""
    (tmp_path / "run.yaml").write_text("model: linear\ndata: synthetic:64\nepochs: 1\nbatch-size: 8\n"
                                       "workers: 0\ndevices: cpu:2\n")
    proc = multigpu("train", "--config", "run.yaml", "--epochs", "2", "--out", "run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["world_size"], config["epochs"], config["global_batch"]) == (2, 2, 16)
    assert config["provenance"]["command"] == "multigpu train --config run.yaml --epochs 2 --out run"
    assert [m["epoch"] for m in read_metrics(tmp_path / "run")] == [1, 2]


def test_bad_input_found_by_two_workers_is_one_line_and_leaves_no_run_folder(tmp_path):
    (tmp_path / "bad.csv").write_text("a,b\n1,x\n2,3\n")
    (tmp_path / "runs" / "earlier").mkdir(parents=True)  # runs/ of before stays as it was
    proc = multigpu("train", "--model", "mlp", "--data", f"timeseries:{tmp_path / 'bad.csv'}",
                    "--devices", "cpu:2", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line or "failed" in line]
    assert errors == [f"multigpu: error: timeseries file '{tmp_path / 'bad.csv'}' column 'b' holds a "
                      "non-numeric value 'x' (row 2): keep only numeric columns, e.g. drop or "
                      "encode column 'b'"], proc.stderr
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["earlier"]


def test_a_bad_file_met_by_one_rank_mid_epoch_is_one_line_and_a_user_s_empty_out_stays_empty(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / "two" / split / cls).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (16, 16), (60 * i, 0, 0)).save(tmp_path / "two" / split / cls / f"{i}.png")
    bad = tmp_path / "two" / "train" / "a" / "bad.png"
    bad.write_bytes(b"not an image")
    # One rank meets the bad file mid-epoch (--bad-images fail: exit 2); the other is stopped by
    # the launcher or loses its peer first, whichever comes: the same one line either way.
    proc = multigpu("train", "--model", "cnn", "--data", f"folder:{tmp_path / 'two'}", "--devices", "cpu:2",
                    "--epochs", "1", "--bad-images", "fail", "--image-size", "16", "--batch-size", "4",
                    "--workers", "0", "--out", tmp_path / "crash")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        f"multigpu: error: cannot read image '{bad}' (cannot identify image file '{bad}'): delete or "
        "replace the file, or pass --bad-images skip to train without it"), proc.stderr[-3000:]
    assert "failed first" not in proc.stderr and not (tmp_path / "crash").exists()
    assert "Traceback" not in proc.stderr, proc.stderr  # rank 0's lost peer stays off the console
    (tmp_path / "mine").mkdir()  # an empty folder of the user's, given as --out
    (tmp_path / "one" / "train" / "a").mkdir(parents=True)
    (tmp_path / "one" / "val" / "a").mkdir(parents=True)
    Image.new("RGB", (16, 16)).save(tmp_path / "one" / "train" / "a" / "0.png")
    Image.new("RGB", (16, 16)).save(tmp_path / "one" / "val" / "a" / "0.png")
    proc = multigpu("train", "--model", "cnn", "--data", f"folder:{tmp_path / 'one'}", "--devices", "cpu:2",
                    "--out", tmp_path / "mine")
    assert proc.returncode == 2 and "has one class folder" in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())


@pytest.mark.extended  # 11 processes on 2 cores: the slowest launch test; CI runs it (make test-all)
def test_eleven_processes_start_train_and_log_every_rank_but_0_in_files(tmp_path):
    """torchrun's --redirects names ranks 0-9 only: 11 CPU processes (a 16-GPU node the same)
    must still start, train and keep each other rank's output in its own file."""
    out = tmp_path / "eleven"
    proc = multigpu("train", "--model", "mlp", "--data", "synthetic:60", "--epochs", "1",
                    "--batch-size", "4", "--workers", "0", "--devices", "cpu:11", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["epoch"] for m in read_metrics(out)] == [1]
    ranks = sorted(int(p.parent.name) for p in out.glob("logs/*/attempt_0/*/stderr.log"))
    assert ranks == list(range(1, 11)), ranks


def _time_line(proc) -> str:
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("time:")]
    return line


def test_loader_workers_started_before_the_model_train_the_weights_of_a_start_at_the_first_step(tmp_path):
    # A fresh run starts its workers while it builds its model (the time: line's "loaders") and
    # trains what a start at the first step trains; a resumed run starts them at its first step,
    # at its own position. (That the main process's random stream is left as it was:
    # tests/unit/test_loaders_continuous.py.)
    args = ["--model", "cnn", "--data", "synthetic:96", "--image-size", "8", "--batch-size", "8",
            "--workers", "2", "--devices", "cpu:1", "--seed", "3", "--logger", "none"]
    early = multigpu("train", *args, "--epochs", "2", "--out", tmp_path / "early")
    late = subprocess.run([sys.executable, "-m", "multigpu", "train", *args, "--epochs", "2",
                           "--out", str(tmp_path / "late")], env=cli_env() | {EARLY_WORKERS_ENV: "0"},
                          capture_output=True, text=True, timeout=240)
    straight = multigpu("train", *args, "--epochs", "3", "--out", tmp_path / "straight")
    resumed = multigpu("train", *args, "--epochs", "3", "--resume", tmp_path / "early",
                       "--out", tmp_path / "resumed")
    for proc in (early, late, straight, resumed):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert " loaders " in _time_line(early) and " loaders " in _time_line(straight)
    assert " loaders " not in _time_line(late) and " loaders " not in _time_line(resumed)
    for (a, b) in (("early", "late"), ("straight", "resumed")):
        wa = torch.load(tmp_path / a / "checkpoints" / "last.pt", weights_only=True)["model"]
        wb = torch.load(tmp_path / b / "checkpoints" / "last.pt", weights_only=True)["model"]
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), (a, b)
