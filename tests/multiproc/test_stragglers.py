"""The rank that holds the others back, named from each rank's own time (core/stragglers.py):
one rank slowed in its compute or its loader, caused for real (a sleep on that rank), on CPU
processes through our launcher; and no report on an even run."""
import json
import os
from pathlib import Path

import pytest

from .conftest import cli_env, read_metrics

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def run(*args, cwd, **env_extra):
    import subprocess
    import sys

    env = cli_env()
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "multigpu", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


TRAIN = ["train", "--model", "mlp", "--data", "synthetic:200", "--batch-size", "8", "--devices", "cpu:2",
         "--workers", "0"]


def test_a_rank_slow_in_its_compute_is_named_on_the_epoch_line_from_the_second_epoch(tmp_path):
    # rank 1's training loss sleeps 20 ms (scripts/slow_compute/sitecustomize.py): a slow GPU
    slowing = str(HERE / "scripts" / "slow_compute")
    proc = run(*TRAIN, "--epochs", "3", "--out", tmp_path / "run", cwd=tmp_path, SLOW_COMPUTE_RANK="1",
               PYTHONPATH=slowing + os.pathsep + cli_env()["PYTHONPATH"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert "rank" not in lines[0], "one slow epoch is not enough"
    host = os.uname().nodename
    for line in lines[1:]:
        said = line.split("; ", 1)[1]
        assert said.startswith(f"rank 1 (host {host}, CPU process 1) computes "), line
        assert said.endswith(" ms a step for it") and "as long as the others: they wait " in said
        wait = int(said.split("they wait ")[1].split()[0])
        assert 10 <= wait <= 40, said  # the 20 ms sleep, give or take a loaded machine's noise
    records = read_metrics(tmp_path / "run")
    for r in records:
        assert [x["rank"] for x in r["ranks"]] == [0, 1]
        assert r["ranks"][1]["compute_ms"] - r["ranks"][0]["compute_ms"] >= 10
        assert all(x["host"] == host and x["data_ms"] < 10 for x in r["ranks"])
    assert "straggler" not in records[0] and records[2]["straggler"] == lines[2].split("; ", 1)[1]


def test_a_rank_slow_in_its_loader_is_named_by_the_library_s_prepared_model(tmp_path):
    # rank 2 of 3 sleeps 20 ms a batch in its Dataset's reads
    proc = run("run", "--devices", "cpu:3", "--log-dir", tmp_path / "logs",
               HERE / "lib_scripts" / "stragglers.py", "3", cwd=tmp_path, SLOW_DATA_RANK="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = json.loads(proc.stdout.splitlines()[-1])
    host = os.uname().nodename
    assert epochs[0]["said"] is None
    for epoch in epochs[1:]:
        assert epoch["said"].startswith(f"rank 2 (host {host}, CPU process 2) waits "), epoch
        assert " ms a step for its data, the others " in epoch["said"]
    warned = [line for line in proc.stderr.splitlines() if "a step for its data" in line]
    assert [w.split(":")[2].strip() for w in warned] == ["epoch 2", "epoch 3"], proc.stderr[-2000:]
    assert all(e["ranks"][2]["data_ms"] >= 15 > e["ranks"][0]["data_ms"] for e in epochs)


def test_an_even_run_of_20_epochs_names_no_rank(tmp_path):
    # 13 batches a rank and epoch: a burst of the machine's other work rarely covers a median
    proc = run(*TRAIN, "--epochs", "20", "--out", tmp_path / "run",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert len(records) == 20 and all(len(r["ranks"]) == 2 for r in records)
    assert not [r["straggler"] for r in records if "straggler" in r]
    assert " computes " not in proc.stdout and " for its data" not in proc.stdout
