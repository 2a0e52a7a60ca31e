"""`multigpu sweep --on slurm` against a real SLURM on localhost (conftest.slurm_cluster): the
sweep's runs go through sbatch as one job array, and everything is read back from the sweep
folder, squeue and the runs' checkpoints."""
import csv
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.multiproc.conftest import cli_env, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.extended]

TRAIN = ["multigpu", "train", "--model", "mlp", "--data", "digits", "--epochs", "1",
         "--batch-size", "64", "--checkpoint-every", "0", "--logger", "csv"]


def sweep(cluster, *args, cwd, env=None) -> subprocess.CompletedProcess:
    """`multigpu sweep ARGS`; its environment (cli_env, with `env` over it) reaches the jobs."""
    return subprocess.run([sys.executable, "-m", "multigpu", "sweep", *map(str, args)], cwd=cwd,
                          env={**cli_env(), "SLURM_CONF": cluster.env["SLURM_CONF"], **(env or {})},
                          capture_output=True, text=True, timeout=300)


def wait_queue_empty(cluster, folder: Path, deadline_s: float = 400) -> None:
    """Until SLURM has none of the sweep's jobs left (its job name is sweep-<folder name>)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        left = cluster.run("squeue", "-h", "-o", "%i", "--name", f"sweep-{folder.name}").stdout
        if not left.strip():
            return
        time.sleep(1)
    pytest.fail(f"SLURM still has the sweep's jobs after {deadline_s} s: {left}\n{cluster.logs()}"
                f"\n{(folder / 'sweep.log').read_text()}")


def summary_rows(folder: Path) -> dict:
    with open(folder / "summary.csv", newline="") as f:
        return {r["name"]: r for r in csv.DictReader(f)}


def test_a_sweep_on_slurm_runs_as_an_array_and_a_rerun_submits_only_what_is_not_done(
        slurm_cluster, tmp_path):
    """Two train runs and one that fails (--retries 1): one array of 3 tasks; the same command
    while they are queued or running submits nothing; afterwards the summary, --status and the
    states say what a local sweep would, and the same command submits the failed run alone."""
    args = ["--on", "slurm", "--devices-per-run", "cpu:1", "--time", "10m", "--retries", "1",
            "--grid", "lr=0.003,0.01", "--out", "sw", "sweep.yaml"]
    (tmp_path / "sweep.yaml").write_text("include:\n  - {lr: -1}\ncommand: " + " ".join(TRAIN) + "\n")
    folder = tmp_path / "sw"
    first = sweep(slurm_cluster, *args, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "] submitted 3 runs to SLURM as job array " in first.stdout
    assert "(each run 1 CPU core, time limit 10m 00s); follow it with: multigpu sweep --status sw" in first.stdout
    # each task takes seconds to start Python and torch: all three are still SLURM's now
    meanwhile = sweep(slurm_cluster, *args, cwd=tmp_path)
    assert meanwhile.returncode == 0, meanwhile.stdout + meanwhile.stderr
    assert ("] nothing to submit: 0 of 3 runs done, 3 queued or running on SLURM; "
            "summary in sw/summary.md") in meanwhile.stdout
    wait_queue_empty(slurm_cluster, folder)

    rows = summary_rows(folder)
    assert {n: r["status"] for n, r in rows.items()} == {"lr=0.003": "done", "lr=0.01": "done", "lr=-1": "failed"}
    for name in ("lr=0.003", "lr=0.01"):
        accuracy = read_metrics(folder / "runs" / name)[-1]["val_accuracy"]
        assert float(rows[name]["final_val_accuracy"]) == pytest.approx(accuracy, rel=1e-3)
        assert json.loads((folder / "runs" / name / "config.json").read_text())["devices"] == "cpu:1"
    assert rows["lr=-1"]["attempts"] == "2"  # --retries 1, inside its SLURM task
    assert "--lr -1 must be a number more than 0" in rows["lr=-1"]["note"]
    state = json.loads((folder / "state" / "lr=-1.json").read_text())
    assert [h["status"] for h in state["history"]] == ["failed", "failed"]
    assert "2 of 3 runs done, 1 failed" in (folder / "summary.md").read_text()
    log = (folder / "sweep.log").read_text()
    assert log.count("] start lr=-1 as SLURM job ") == 2 and log.count("] done lr=0.0") == 2

    status = sweep(slurm_cluster, "--status", "sw", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[0] == ("sweep sw: 3 runs: 2 done, 1 failed; not on SLURM's "
                                             "queue (run the same command again to submit the rest)")

    again = sweep(slurm_cluster, *args, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "] submitted 1 run to SLURM as job array " in again.stdout
    wait_queue_empty(slurm_cluster, folder)
    log = (folder / "sweep.log").read_text()
    assert log.count("] start lr=-1 as SLURM job ") == 4 and log.count("] start lr=0.0") == 2
    assert summary_rows(folder)["lr=-1"]["attempts"] == "4"


def test_sigusr1_before_the_time_limit_requeues_the_run_and_it_ends_as_if_never_stopped(
        slurm_cluster, tmp_path):
    """SIGUSR1 to the batch step, as SLURM's --signal=B:USR1@90 sends it before the time limit:
    the run saves a checkpoint and stops, its task is requeued (submitit's checkpoint()), starts
    again and resumes; the final weights and metrics are those of the same command run here
    without a stop (--deterministic, one CPU process)."""
    command = ["multigpu", "train", "--model", "mlp", "--data", "synthetic:30000", "--epochs", "2",
               "--batch-size", "16", "--checkpoint-every", "0", "--logger", "csv", "--log-every",
               "10", "--deterministic"]
    folder = tmp_path / "sw"
    first = sweep(slurm_cluster, "--on", "slurm", "--devices-per-run", "cpu:1", "--grid", "seed=1",
                  "--out", "sw", "--", *command, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    steps = folder / "runs" / "seed=1" / "steps.csv"
    deadline = time.monotonic() + 120
    while not steps.exists() and time.monotonic() < deadline:  # it trains
        time.sleep(0.2)
    assert steps.exists(), (folder / "logs" / "seed=1.log").read_text()
    job = json.loads((folder / "state" / "seed=1.json").read_text())["job"]
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
    wait_queue_empty(slurm_cluster, folder)

    state = json.loads((folder / "state" / "seed=1.json").read_text())
    assert [h["status"] for h in state["history"]] == ["stopped", "done"], state
    assert state["history"][0]["note"] == ("requeued by SLURM before its time limit (SIGUSR1); it "
                                           "resumes from its checkpoint")
    assert state["job"] == job and state["attempts"] == 2
    log = (folder / "sweep.log").read_text()
    assert f"] start seed=1 as SLURM job {job} on " in log
    assert "] stopped seed=1 after " in log and ", attempt 2 (resuming from its checkpoint)" in log
    run_log = (folder / "logs" / "seed=1.log").read_text()
    assert "multigpu: stopped by SIGUSR1 in epoch" in run_log and "resumed from " in run_log
    record = slurm_cluster.run("scontrol", "show", "job", job).stdout  # kept MinJobAge (300 s)
    assert "Restarts=1 " in record and "JobState=COMPLETED " in record, record

    ref = tmp_path / "ref"
    alone = subprocess.run([sys.executable, "-m", *command, "--seed", "1", "--devices", "cpu:1",
                            "--out", ref], cwd=tmp_path, capture_output=True, text=True,
                           env={**cli_env(), "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert alone.returncode == 0, alone.stderr[-3000:]
    swept = torch.load(folder / "runs" / "seed=1" / "checkpoints" / "last.pt", weights_only=True)
    plain = torch.load(ref / "checkpoints" / "last.pt", weights_only=True)
    assert swept["model"].keys() == plain["model"].keys()
    for key, value in plain["model"].items():
        assert torch.equal(swept["model"][key], value), key
    learnt = ("epoch", "train_loss", "val_loss", "val_accuracy")  # not the timings
    assert [{k: r[k] for k in learnt} for r in read_metrics(folder / "runs" / "seed=1")] == \
        [{k: r[k] for k in learnt} for r in read_metrics(ref)]


def test_sbatch_refusals_are_one_line_with_the_flag_to_change(slurm_cluster, tmp_path):
    """A partition the cluster lacks, and a controller that does not answer (this cluster's
    slurm.conf with the controller's port closed): one line each, exit 2."""
    args = ["--on", "slurm", "--devices-per-run", "cpu:1", "--grid", "lr=0.003,0.01", "--", *TRAIN]
    proc = sweep(slurm_cluster, "--partition", "nosuch", "--out", "a", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("multigpu: error: --on slurm: sbatch refused the job array: "
                                   "Batch job submission failed: Invalid partition name specified; "
                                   "check --partition, --time, --devices-per-run and --slurm-arg")
    gpus = [a if a != "cpu:1" else "1" for a in args]  # this cluster's node has no GPU
    proc = sweep(slurm_cluster, "--out", "g", *gpus, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "multigpu: error: --on slurm: sbatch refused the job array: Invalid generic resource "
        "(gres) specification: each run asks for 1 GPU (--devices-per-run: "
        "1 GPU unless given), which that partition's nodes do not offer; name a partition with GPUs "
        "(--partition), or give CPU runs --devices-per-run cpu:N")
    conf = Path(slurm_cluster.env["SLURM_CONF"])
    closed = tmp_path / "closed.conf"
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    closed.write_text(re.sub(r"SlurmctldPort=\d+", f"SlurmctldPort={port}", conf.read_text()))
    proc = subprocess.run([sys.executable, "-m", "multigpu", "sweep", "--out", "b", *args],
                          cwd=tmp_path, env={**cli_env(), "SLURM_CONF": str(closed)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "multigpu: error: --on slurm: sbatch cannot reach the SLURM controller (slurmctld): Batch "
        "job submission failed: Unable to contact slurm controller (connect failure); check that "
        "it runs (scontrol ping) and that SLURM_CONF names this cluster")
