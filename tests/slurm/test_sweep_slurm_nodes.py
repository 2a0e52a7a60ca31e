"""`multigpu sweep --on slurm --nodes-per-run 2` against a real SLURM of two nodes on this machine
(conftest.slurm_two_nodes: two slurmd): each run is a job of two nodes, srun starts its task on
each, and the two `multigpu train` join through the launcher's SLURM support. Read back from the
sweep folder and compared with the same training run as two processes on one machine."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.multiproc.conftest import cli_env, read_metrics
from tests.slurm.test_sweep_slurm import summary_rows, sweep, wait_queue_empty

pytestmark = [pytest.mark.slow, pytest.mark.extended]

TRAIN = ["multigpu", "train", "--model", "mlp", "--data", "synthetic:400", "--epochs", "2",
         "--batch-size", "16", "--checkpoint-every", "0", "--logger", "csv", "--deterministic"]


def test_a_run_of_two_nodes_trains_as_two_processes_on_one_machine(slurm_two_nodes, tmp_path):
    """Two runs of two nodes each, one CPU process a node: node 0 alone writes the state, the
    events and the summary (one start per run), node 1 logs beside it; the final weights and
    metrics equal those of the same command with --devices cpu:2 here."""
    folder = tmp_path / "sw"
    first = sweep(slurm_two_nodes, "--on", "slurm", "--nodes-per-run", "2", "--devices-per-run",
                  "cpu:1", "--time", "10m", "--grid", "seed=1,2", "--out", "sw", "--", *TRAIN,
                  cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "] submitted 2 runs to SLURM as job array " in first.stdout
    assert "(each run 2 nodes, 1 CPU core each, time limit 10m 00s)" in first.stdout
    wait_queue_empty(slurm_two_nodes, folder)

    rows = summary_rows(folder)
    logs = {n: (folder / "logs" / f"{n}.log").read_text() for n in ("seed=1", "seed=2")}
    assert {n: r["status"] for n, r in rows.items()} == {"seed=1": "done", "seed=2": "done"}, logs
    events = (folder / "sweep.log").read_text()
    for name in ("seed=1", "seed=2"):
        assert events.count(f"] start {name} as SLURM job ") == 1, events
        assert events.count(f"] done {name}") == 1, events
        state = json.loads((folder / "state" / f"{name}.json").read_text())
        host = socket.gethostname()
        assert state["devices"] == f"2 nodes ({host},{host}-n2), cpu:1 each"
        assert state["attempts"] == 1 and [h["status"] for h in state["history"]] == ["done"]
        node1 = (folder / "logs" / f"{name}.node1.log").read_text()
        assert node1.count("=== attempt 1, ") == 1 and "--master-port" in node1
        assert not (folder / "logs" / f"{name}.node0.log").exists()

    for seed in (1, 2):
        ref = tmp_path / f"ref{seed}"
        alone = subprocess.run([sys.executable, "-m", *TRAIN, "--seed", str(seed), "--devices",
                                "cpu:2", "--out", ref], cwd=tmp_path, capture_output=True,
                               text=True, env={**cli_env(), "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
        assert alone.returncode == 0, alone.stderr[-3000:]
        run = folder / "runs" / f"seed={seed}"
        swept = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
        plain = torch.load(ref / "checkpoints" / "last.pt", weights_only=True)
        assert swept["model"].keys() == plain["model"].keys()
        for key, value in plain["model"].items():
            assert torch.equal(swept["model"][key], value), key
        learnt = ("epoch", "train_loss", "val_loss", "val_accuracy")  # not the timings
        assert [{k: r[k] for k in learnt} for r in read_metrics(run)] == \
            [{k: r[k] for k in learnt} for r in read_metrics(ref)]


LONG = ["multigpu", "train", "--model", "mlp", "--data", "synthetic:30000", "--epochs", "2",
        "--batch-size", "16", "--checkpoint-every", "0", "--logger", "csv", "--log-every", "10",
        "--deterministic"]


def start_one_run(cluster, tmp_path, *extra) -> tuple[Path, str]:
    """A sweep of one run of two nodes (LONG), once it trains: (its folder, its job)."""
    folder = tmp_path / "sw"
    first = sweep(cluster, "--on", "slurm", "--nodes-per-run", "2", "--devices-per-run", "cpu:1",
                  "--grid", "seed=1", "--out", "sw", *extra, "--", *LONG, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    steps = folder / "runs" / "seed=1" / "steps.csv"
    deadline = time.monotonic() + 180
    while not steps.exists() and time.monotonic() < deadline:  # both nodes met, rank 0 trains
        time.sleep(0.2)
    assert steps.exists(), (folder / "logs" / "seed=1.log").read_text()
    return folder, json.loads((folder / "state" / "seed=1.json").read_text())["job"]


def test_sigusr1_stops_every_node_with_one_checkpoint_and_the_requeued_run_ends_as_never_stopped(
        slurm_two_nodes, tmp_path):
    """SIGUSR2 to every process of the job's step, as --signal=USR2@90 sends it before the time
    limit: every node's task passes one SIGUSR1 to its part of the run (each rank gets one: a
    second would stop it at once, without a checkpoint), the ranks stop together with a
    checkpoint, node 0 requeues the job, both nodes resume; the weights and metrics are those of
    the same command as two CPU processes on one machine, never stopped."""
    folder, job = start_one_run(slurm_two_nodes, tmp_path)
    slurm_two_nodes.run("scancel", "--signal=USR2", job)  # every process of the step, not the shell
    wait_queue_empty(slurm_two_nodes, folder)

    state = json.loads((folder / "state" / "seed=1.json").read_text())
    assert [h["status"] for h in state["history"]] == ["stopped", "done"], state
    assert state["job"] == job and state["attempts"] == 2
    events = (folder / "sweep.log").read_text()
    assert events.count("] start seed=1 as SLURM job ") == 2, events
    assert ", attempt 2 (resuming from its checkpoint)" in events
    for log in ("seed=1.log", "seed=1.node1.log"):
        text = (folder / "logs" / log).read_text()
        assert "multigpu: stopped by SIGUSR1 in epoch" in text, text
        assert "again: stopping at once" not in text, text
        assert text.count("=== attempt ") == 2 and "=== attempt 2, " in text, text
        assert "--resume " in text.split("=== attempt 2, ")[1].splitlines()[0]
    record = slurm_two_nodes.run("scontrol", "show", "job", job).stdout
    assert "Restarts=1 " in record and "JobState=COMPLETED " in record, record

    ref = tmp_path / "ref"
    alone = subprocess.run([sys.executable, "-m", *LONG, "--seed", "1", "--devices", "cpu:2",
                            "--out", ref], cwd=tmp_path, capture_output=True, text=True,
                           env={**cli_env(), "CUDA_VISIBLE_DEVICES": ""}, timeout=400)
    assert alone.returncode == 0, alone.stderr[-3000:]
    run = folder / "runs" / "seed=1"
    swept = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    plain = torch.load(ref / "checkpoints" / "last.pt", weights_only=True)
    for key, value in plain["model"].items():
        assert torch.equal(swept["model"][key], value), key
    learnt = ("epoch", "train_loss", "val_loss", "val_accuracy")
    assert [{k: r[k] for k in learnt} for r in read_metrics(run)] == \
        [{k: r[k] for k in learnt} for r in read_metrics(ref)]


def node1_launcher(folder: Path) -> psutil.Process:
    """Node 1's `multigpu train` of seed=1 (its environment says SLURM_NODEID=1)."""
    out = str(folder / "runs" / "seed=1")
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "train" in cmd and out in cmd:
            try:
                if proc.environ().get("SLURM_NODEID") == "1" and "-m" in cmd:
                    return proc
            except psutil.Error:
                continue
    pytest.fail(f"no node-1 launcher of {out} found")


def test_a_node_killed_fails_the_run_once(slurm_two_nodes, tmp_path):
    """kill -9 of node 1's part of the run (its launcher's whole process group): node 0's part
    fails with it, and the run is failed once: one failed attempt in its state, one start and
    one failure in the sweep's log, the job FAILED."""
    folder, job = start_one_run(slurm_two_nodes, tmp_path)
    os.killpg(node1_launcher(folder).pid, signal.SIGKILL)
    wait_queue_empty(slurm_two_nodes, folder)

    state = json.loads((folder / "state" / "seed=1.json").read_text())
    assert [h["status"] for h in state["history"]] == ["failed"], state
    assert state["attempts"] == 1
    events = (folder / "sweep.log").read_text()
    assert events.count("] start seed=1 ") == 1 and events.count("] FAILED seed=1 ") == 1, events
    node1 = (folder / "logs" / "seed=1.node1.log").read_text()
    assert node1.count("=== attempt ") == 1, node1
    assert summary_rows(folder)["seed=1"]["status"] == "failed"
    record = slurm_two_nodes.run("scontrol", "show", "job", job).stdout
    assert "JobState=FAILED " in record, record


def test_a_run_that_fails_on_node_1_alone_ends_as_node_0_recorded_it(slurm_two_nodes, tmp_path):
    """A command that succeeds on node 0 and fails on node 1 (exit 3), with --retries 1: node 1
    does not retry alone (a retried `multigpu train` would wait out its rendezvous for a node 0
    that has finished); the run is done, once, on both nodes, and the job COMPLETED. Node 1's
    task starts 4 s late (a loaded machine), after node 0's attempt has ended: it is the same
    attempt, not the next (which node 0 never records: node 1 waited 120 s for it, then failed)."""
    late = tmp_path / "late"
    late.mkdir()
    (late / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('SLURM_NODEID') == '1' and 'SLURM_STEP_ID' in os.environ:\n"
        "    time.sleep(4)\n")
    folder = tmp_path / "sw"
    first = sweep(slurm_two_nodes, "--on", "slurm", "--nodes-per-run", "2", "--devices-per-run",
                  "cpu:1", "--retries", "1", "--grid", "seed=1", "--out", "sw", "--", "sh", "-c",
                  'test "$SLURM_NODEID" = 0 || exit 3', "sh", "{seed}", cwd=tmp_path,
                  env={"PYTHONPATH": f"{late}:{cli_env()['PYTHONPATH']}"})
    assert first.returncode == 0, first.stdout + first.stderr
    wait_queue_empty(slurm_two_nodes, folder)
    state = json.loads((folder / "state" / "seed=1.json").read_text())
    assert state["attempts"] == 1 and [h["status"] for h in state["history"]] == ["done"], state
    node1 = (folder / "logs" / "seed=1.node1.log").read_text()
    assert node1.count("=== attempt 1, ") == 1 and node1.count("=== attempt ") == 1, node1
    record = slurm_two_nodes.run("scontrol", "show", "job", state["job"]).stdout
    assert "JobState=COMPLETED " in record, record
