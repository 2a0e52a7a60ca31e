"""The same command under any scheduler: `--out R --resume R`, run again after each kill, is one
run. A SLURM --requeue, a Kubernetes pod restart and a SkyPilot managed job's relaunch all run the
job's command again as it was; every process of the job is killed before (kill -9 here, the end of
a scheduler's grace period). Two "nodes" on this machine, given Kubeflow Trainer's or SkyPilot's
variables and no launch flags, train one run across them, and go on after both were killed.

Every fault is real: kill -9 of the launcher and all of its workers at once, after a checkpoint.
"""
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .conftest import cli_env, read_metrics, track
from .test_faults import ARGS, N, assert_same_weights, check_epochs, wait_for_checkpoint

pytestmark = pytest.mark.slow


def start(out: Path, env: dict | None = None, devices: str = "cpu:2", *extra) -> subprocess.Popen:
    """The job's one command, the same every time."""
    proc = subprocess.Popen([sys.executable, "-m", "multigpu", "train", *ARGS, "--devices", devices,
                             "--out", str(out), "--resume", str(out), *extra], env=env or cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    track(proc)
    return proc


def kill_all(proc: subprocess.Popen) -> None:
    """kill -9 of the launcher and every process under it at once, as a node's end would."""
    try:
        everyone = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        everyone = []
    for p in everyone:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(everyone, timeout=30)
    proc.communicate(timeout=30)


def newest_step(out: Path) -> int:
    from multigpu.train.checkpoints.checkpoint_store import CheckpointStore

    entries = CheckpointStore(out / "checkpoints").entries()
    return entries[-1].global_step if entries else -1


def test_the_same_command_three_times_with_kills_between_is_one_run(faults_reference, tmp_path):
    out = tmp_path / "job"
    for _ in range(2):  # killed twice, each time after a checkpoint newer than the last
        proc = start(out)
        wait_for_checkpoint(out, proc, newer_than=newest_step(out))
        kill_all(proc)
    last = start(out)
    stdout, stderr = last.communicate(timeout=300)
    assert last.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout
    check_epochs(out)  # each epoch, each logged step, once
    assert_same_weights(faults_reference, out, "the same command three times, killed twice")


def _free_port() -> int:
    with socket.socket() as s:  # test-only: a port for the two "nodes" to agree on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_env(scheduler: str, rank: int, port: int) -> dict:
    env = cli_env()
    for k in list(env):
        if k.startswith(("SLURM_", "PET_", "SKYPILOT_")):
            del env[k]
    if scheduler == "kubeflow":
        env.update(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(rank),
                   PET_MASTER_ADDR="localhost", PET_MASTER_PORT=str(port))
    else:
        env.update(SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NODE_IPS="127.0.0.1\n127.0.0.1",
                   SKYPILOT_NUM_NODES="2", SKYPILOT_NUM_GPUS_PER_NODE="1")
    return env


@pytest.mark.parametrize("scheduler", ["kubeflow", pytest.param("skypilot", marks=pytest.mark.extended)])
def test_two_nodes_from_the_scheduler_s_variables_killed_then_started_again_end_equal(
        faults_reference, tmp_path, scheduler):
    out = tmp_path / "job"
    port = _free_port()
    envs = [_node_env(scheduler, rank, port) for rank in (0, 1)]
    # SkyPilot names no port: multigpu's default (29500), here a free one, as a shared machine needs
    extra = ["--master-port", str(port)] if scheduler == "skypilot" else []
    nodes = [start(out, envs[0], "cpu:1", *extra), start(out, envs[1], "cpu:1", *extra)]
    try:
        wait_for_checkpoint(out, nodes[0])
    except AssertionError:
        for n in nodes:
            kill_all(n) if n.poll() is None else None
        raise AssertionError([n.communicate()[1][-1500:] for n in nodes]) from None
    kill_all(nodes[1])  # node 1 first, then node 0 (gone already, or killed now)
    time.sleep(0.5)
    kill_all(nodes[0])
    step = newest_step(out)
    nodes = [start(out, envs[0], "cpu:1", *extra), start(out, envs[1], "cpu:1", *extra)]
    results = [n.communicate(timeout=300) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [err[-2000:] for _, err in results]
    said = "".join(o + e for o, e in results)
    assert "resumed from" in said and f"step {step}" in said, said[-3000:]
    assert [r["epoch"] for r in read_metrics(out)] == [1, 2, 3]
    assert all(r["train_samples"] == N for r in read_metrics(out))
    assert_same_weights(faults_reference, out, f"{scheduler}: two nodes killed after step {step}")
