"""`multigpu sweep --on slurm --nodes-per-run 2` against a real SLURM of two nodes on this machine
(conftest.slurm_two_nodes: two slurmd): each run is a job of two nodes, srun starts its task on
each, and the two `multigpu train` join through the launcher's SLURM support. Read back from the
sweep folder and compared with the same training run as two processes on one machine."""
import json
import socket
import subprocess
import sys

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
