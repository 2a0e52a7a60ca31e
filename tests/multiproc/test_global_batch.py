"""--global-batch-size G (setup(global_batch_size=G)): 2, 3 and 4 CPU processes train the same
optimizer steps on the same samples and end with the same weights; a run stopped on 4 processes
and resumed on 2 ends as one never stopped.

Tolerance: the weights agree to 1e-6 (absolute; they are at most about 0.4 here), not bit for
bit. Each optimizer step's gradient is the same sum over the same G samples, but added up in
another order: each rank sums its share (3, 4 or 6 samples per micro-batch, 1 to 3 micro-batches),
then gloo's all-reduce sums the ranks. fp32 addition is not associative: each reordering moves a
gradient by a few units in the last place (about 3e-8 at 0.4), and over these runs' ~100 steps
measured differences stay below 1e-7 (8.9e-8 at most, run to run); 1e-6 is ten times that. The
same runs with a per-device --batch-size 4 instead (global batches of 8 and 16 on 2 and 4
processes) differ by 0.39, as much as the weights themselves: the tolerance tells the two apart
by more than five orders of magnitude.
"""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from multigpu.train.checkpoints.checkpoint_store import CheckpointStore

from .conftest import cli_env, multigpu, read_metrics, track

pytestmark = pytest.mark.slow

N = 610  # 25 steps of 24 and 10 samples more, trained with the 25th step
TOLERANCE = 1e-6
ARGS = ["--model", "mlp", "--data", f"synthetic:{N}", "--epochs", "2", "--global-batch-size",
        "24", "--batch-size", "4", "--optimizer", "sgd", "--lr", "0.05", "--workers", "0",
        "--seed", "4", "--checkpoint-every", "10", "--keep", "100", "--deterministic"]
# how 24 is made: --batch-size 4 is the largest micro-batch; 12, 8 and 6 per device
MADE = {2: "4 per device x 2 devices x 3 micro-batches", 3: "4 per device x 3 devices x 2 micro-batches",
        4: "3 per device x 4 devices x 2 micro-batches"}
SCRIPTS = Path(__file__).parent / "lib_scripts"


def weights(out: Path) -> dict:
    return torch.load(out / "checkpoints" / "last.pt", weights_only=True)["model"]


def largest_difference(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def train(out: Path, devices: int, *extra) -> subprocess.CompletedProcess:
    proc = multigpu("train", *ARGS, "--devices", f"cpu:{devices}", "--out", out, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory, global_batch_on_2) -> dict[int, tuple[Path, str]]:
    made = {2: global_batch_on_2}  # conftest's: test_lost_device compares with it too
    for devices in (3, 4):
        out = tmp_path_factory.mktemp("global") / f"cpu{devices}"
        proc = train(out, devices)
        made[devices] = out, proc.stdout + proc.stderr
    return made


@pytest.mark.smoke
@pytest.mark.parametrize("devices", [3, 4])
def test_2_3_and_4_processes_at_one_global_batch_end_with_the_same_weights(runs, devices):
    reference, _ = runs[2]
    out, output = runs[devices]
    assert f"--global-batch-size 24: {MADE[devices]} (chosen from the devices" in output
    assert f"--global-batch-size 24: {MADE[2]}" in runs[2][1]
    assert "last step: the last 10 of 610 samples are trained with the step before them (34 " \
           "samples, on any device count)" in output
    assert [r["train_samples"] for r in read_metrics(out)] == [N, N]
    config = json.loads((out / "config.json").read_text())
    assert (config["global_batch"], config["global_batch_size"], config["batch_size"],
            config["accumulate"]) == (24, 24, 4, 1)  # the flags as given: a repeat chooses again
    assert largest_difference(reference, out) < TOLERANCE


def _stop_at_first_checkpoint(out: Path, devices: int) -> str:
    proc = subprocess.Popen([sys.executable, "-m", "multigpu", "train", *ARGS, "--devices",
                             f"cpu:{devices}", "--out", str(out)], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    track(proc)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        try:
            entries = CheckpointStore(out / "checkpoints").entries()
        except Exception:  # mid-rename: look again
            entries = []
        if entries:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, (stdout + stderr)[-3000:]
    return stdout + stderr


def test_a_checkpoint_of_4_processes_resumed_on_2_ends_as_the_run_never_stopped(runs, tmp_path):
    reference, _ = runs[4]
    inside = [e for e in CheckpointStore(reference / "checkpoints").entries()
              if e.run["position"] and e.run["epoch"] == 1]
    assert inside, "the 4-process run keeps a checkpoint from inside its first epoch"
    entry = inside[len(inside) // 2]
    out = tmp_path / "run"
    resumed = train(out, 2, "--resume", reference / "checkpoints" / entry.file)
    said = resumed.stdout + resumed.stderr
    assert (f"{entry.run['position']} of {N} samples in" in said
            and f"--global-batch-size 24 kept: {MADE[2]} (saved as {MADE[4]})" in said), said[-3000:]
    assert [(r["epoch"], r["train_samples"]) for r in read_metrics(out)] == [(1, N), (2, N)]
    assert largest_difference(runs[2][0], out) < TOLERANCE


@pytest.mark.extended  # two launches more, the first stopped by SIGTERM: about a minute here
@pytest.mark.parametrize("stopped_on, resumed_on", [(4, 2), (2, 3)])
def test_a_run_stopped_on_some_processes_and_resumed_on_others_ends_as_one_never_stopped(
        runs, tmp_path, stopped_on, resumed_on):
    out = tmp_path / "run"
    stopped = _stop_at_first_checkpoint(out, stopped_on)
    assert "stopped by SIGTERM " in stopped, stopped[-3000:]
    resumed = train(out, resumed_on, "--resume", out)
    said = resumed.stdout + resumed.stderr
    assert f"--global-batch-size 24 kept: {MADE[resumed_on]} (saved as {MADE[stopped_on]})" in said, \
        said[-3000:]
    records = read_metrics(out)
    assert [(r["epoch"], r["train_samples"]) for r in records] == [(1, N), (2, N)]
    assert largest_difference(runs[2][0], out) < TOLERANCE


@pytest.mark.smoke
def test_a_global_batch_the_devices_cannot_share_is_one_line_before_any_launch(tmp_path):
    proc = multigpu("train", *ARGS[:7], "25", *ARGS[8:], "--devices", "cpu:2", "--out", tmp_path / "r")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("multigpu: error: --global-batch-size 25 cannot be shared out "
                                   "evenly over this run's 2 devices (each takes the same number "
                                   "of samples): give --global-batch-size 24 or --global-batch-size 30")
    assert not (tmp_path / "r").exists()
    beside = multigpu("train", *ARGS, "--accumulate", "2", "--devices", "cpu:2")
    assert beside.returncode == 2 and beside.stderr.strip() == (
        "multigpu: error: --accumulate 2 and --global-batch-size 24 both set the accumulation: "
        "give --global-batch-size 24 alone (it chooses the accumulation from the devices)")


def test_a_users_loop_with_setup_global_batch_size_trains_as_one_process_does(tmp_path):
    def run(devices: int) -> dict:
        proc = multigpu("run", "--devices", f"cpu:{devices}", "--log-dir", tmp_path / f"l{devices}",
                        SCRIPTS / "global_batch.py", 12, 4)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    one, two, three = run(1), run(2), run(3)
    # 70 samples: 5 steps of 12, the 10 left trained with the 5th; 2 epochs. At most 4 per
    # device: 4 x 3 micro-batches on one process, 3 x 2 on two, 4 x 1 on three
    assert [r["plan"] for r in (one, two, three)] == [[4, 3], [3, 2], [4, 1]]
    for many in (two, three):
        assert many["optimizer_steps"] == one["optimizer_steps"] == 10
        for a, b in zip(one["weights"], many["weights"]):
            assert a == pytest.approx(b, abs=TOLERANCE)
