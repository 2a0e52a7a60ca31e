"""`multigpu sweep` end to end on CPU: real runs, real signals, results read back from the files.

The runs are tiny `multigpu train` jobs (digits) or a few lines of Python that record when and
on which core they ran (RECORDER), so that packing and leases can be checked from the outside.
"""
import csv
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import cli_env, multigpu, read_metrics

pytestmark = pytest.mark.slow

TRAIN = ["multigpu", "train", "--model", "mlp", "--data", "digits", "--epochs", "1",
         "--batch-size", "{batch_size}", "--checkpoint-every", "0", "--logger", "csv"]

# {out}/record.json gets [start, end, cores]; it sleeps SLEEP seconds (default 1).
RECORDER = textwrap.dedent("""
    import json, os, sys, time
    out = sys.argv[1]
    start = time.time()
    with open(os.path.join(out, "starts"), "a") as f:
        f.write(f"{start}\\n")
    time.sleep(float(os.environ.get("SLEEP", "1")))
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"epoch": 1, "val_loss": float(sys.argv[2])}) + "\\n")
    with open(os.path.join(out, "record.json"), "w") as f:
        json.dump([start, time.time(), sorted(os.sched_getaffinity(0))], f)
    sys.exit(int(sys.argv[2]) == 99)
""")


def sweep_popen(*args, cwd, env=None):
    return subprocess.Popen([sys.executable, "-m", "multigpu", "sweep", *map(str, args)], cwd=cwd,
                            env={**cli_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def summary_rows(folder: Path) -> list[dict]:
    with open(folder / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def starts(folder: Path, name: str) -> int:
    path = folder / "runs" / name / "starts"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture
def recorder(tmp_path):
    path = tmp_path / "recorder.py"
    path.write_text(RECORDER)
    return path


@pytest.mark.smoke
def test_grid_of_train_runs_two_at_once_one_failing(tmp_path, monkeypatch):
    """2x2 grid of real train runs on cpu:1 each, 2 at once, plus a combination that fails:
    4 done rows with their grid values and accuracies, the failure with its cause; a re-run of
    the same command starts nothing."""
    env_lease = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases")}
    args = ["--grid", "lr=0.003,0.01", "--grid", "batch_size=32,64", "--devices", "cpu:2",
            "--devices-per-run", "cpu:1", "--max-parallel", "2", "--out", "sw"]
    (tmp_path / "sweep.yaml").write_text(
        "include:\n  - {lr: -1, batch_size: 32}\ncommand: " + " ".join(TRAIN) + "\n")
    proc = subprocess.run([sys.executable, "-m", "multigpu", "sweep", *args, "sweep.yaml"],
                          cwd=tmp_path, env={**cli_env(), **env_lease}, capture_output=True,
                          text=True, timeout=600)
    folder = tmp_path / "sw"
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["lr"], r["batch_size"]): r for r in summary_rows(folder)}
    assert set(rows) == {("0.003", "32"), ("0.003", "64"), ("0.01", "32"), ("0.01", "64"), ("-1", "32")}
    for key, row in rows.items():
        if key[0] == "-1":
            assert row["status"] == "failed"
            assert "--lr -1 must be a number more than 0" in row["note"]
            assert row["best_val_accuracy"] == ""
        else:
            assert row["status"] == "done", row
            run = folder / "runs" / row["name"]
            accuracy = read_metrics(run)[-1]["val_accuracy"]
            assert float(row["final_val_accuracy"]) == pytest.approx(accuracy, rel=1e-3)
            config = json.loads((run / "config.json").read_text())
            assert (config["lr"], config["batch_size"], config["devices"]) == (float(key[0]), int(key[1]), "cpu:1")
    assert (folder / "summary.png").read_bytes()[:4] == b"\x89PNG"
    assert "FAILED lr=-1,batch_size=32" in proc.stdout
    md = (folder / "summary.md").read_text()
    assert "4 of 5 runs done, 1 failed" in md

    log_before = (folder / "sweep.log").read_text()
    again = subprocess.run([sys.executable, "-m", "multigpu", "sweep", *args, "sweep.yaml"],
                           cwd=tmp_path, env={**cli_env(), **env_lease}, capture_output=True,
                           text=True, timeout=600)
    new_lines = (folder / "sweep.log").read_text()[len(log_before):]
    started = [ln for ln in new_lines.splitlines() if "] start " in ln]
    assert started == [next(ln for ln in new_lines.splitlines() if "start lr=-1" in ln)]  # only the failed one
    assert again.returncode == 1


def test_ctrl_c_stops_runs_with_a_checkpoint_and_a_rerun_resumes_them(tmp_path):
    """SIGINT to the sweep: each run saves a checkpoint and stops; the same command again resumes
    them and the runs end with every epoch once."""
    # About 3 s an epoch here: the signal comes once both runs train, whichever started first
    # (seconds apart on a loaded machine), with most of their work still ahead.
    cmd = ["--grid", "seed=1,2", "--devices", "cpu:2", "--devices-per-run", "cpu:1", "--out", "sw",
           "--", "multigpu", "train", "--model", "mlp", "--data", "synthetic:4000", "--epochs", "3",
           "--batch-size", "16", "--checkpoint-every", "0", "--logger", "csv", "--log-every", "10"]
    env = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases")}
    sweep = sweep_popen(*cmd, cwd=tmp_path, env=env)
    folder = tmp_path / "sw"
    deadline = time.time() + 120
    while time.time() < deadline:  # both runs have logged a training step
        if all((folder / "runs" / f"seed={s}" / "steps.csv").exists() for s in (1, 2)):
            break
        time.sleep(0.1)
    sweep.send_signal(signal.SIGINT)
    out, _ = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, out
    assert "stopping 2 run(s)" in out and "run the same command again to go on" in out
    states = [json.loads((folder / "state" / f"seed={s}.json").read_text()) for s in (1, 2)]
    assert [s["status"] for s in states] == ["stopped", "stopped"], states
    stops, logged = {}, {}
    for s in (1, 2):
        said = re.search(r"stopped by SIGTERM .*, step (\d+): checkpoint (\S+) is complete",
                         (folder / "logs" / f"seed={s}.log").read_text())
        assert said, (folder / "logs" / f"seed={s}.log").read_text()[-2000:]
        stops[s] = int(said.group(1)), said.group(2)
        logged[s] = (folder / "runs" / f"seed={s}" / "steps.csv").read_text().splitlines()

    again = subprocess.run([sys.executable, "-m", "multigpu", "sweep", *cmd], cwd=tmp_path,
                           env={**cli_env(), **env}, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert again.stdout.count("(resuming from its checkpoint)") == 2
    for s in (1, 2):
        run = folder / "runs" / f"seed={s}"
        assert [r["epoch"] for r in read_metrics(run)] == [1, 2, 3]
        step, checkpoint = stops[s]
        log = (folder / "logs" / f"seed={s}.log").read_text()
        assert f"resumed from {checkpoint} (epoch 1, " in log and f", step {step}; " in log, log[-2000:]
        # on from that step, not from step 0 again with its weights: the rows logged up to it
        # are kept as they were, then each tenth step of the 3 x 250 is logged once, in order
        rows = (run / "steps.csv").read_text().splitlines()
        kept = [row for row in logged[s][1:] if int(row.split(",")[0]) <= step]
        assert rows[:1 + len(kept)] == logged[s][:1] + kept, (step, rows[:12])
        assert [int(row.split(",")[0]) for row in rows[1:]] == list(range(10, 3 * 250 + 1, 10))


def test_kill_9_of_the_sweep_ends_its_runs_and_a_rerun_finishes_only_what_was_missing(tmp_path, recorder):
    cmd = ["--grid", "v=1,2,3,4", "--devices", "cpu:1", "--devices-per-run", "cpu:1", "--out", "sw",
           "--", sys.executable, recorder, "{out}", "{v}"]
    env = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases"), "SLEEP": "2"}
    sweep = sweep_popen(*cmd, cwd=tmp_path, env=env)
    folder = tmp_path / "sw"
    deadline = time.time() + 60
    while time.time() < deadline and starts(folder, "v=2") == 0:  # v=1 done, v=2 running
        time.sleep(0.05)
    state = json.loads((folder / "state" / "v=2.json").read_text())
    while time.time() < deadline and not state.get("pid"):  # its pid is written once Popen returns
        time.sleep(0.05)
        state = json.loads((folder / "state" / "v=2.json").read_text())
    assert state["status"] == "running" and state["pid"], state
    os.kill(sweep.pid, signal.SIGKILL)
    sweep.wait()
    for _ in range(50):  # the running child got SIGTERM from the kernel (PR_SET_PDEATHSIG)
        try:
            os.kill(state["pid"], 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the run outlived its sweep")
    status = multigpu("sweep", "--status", "sw", cwd=tmp_path)
    assert status.returncode == 0
    assert "1 done" in status.stdout and "not running" in status.stdout, status.stdout

    again = subprocess.run([sys.executable, "-m", "multigpu", "sweep", *cmd], cwd=tmp_path,
                           env={**cli_env(), **env, "SLEEP": "0"}, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "] sweep of 4 runs (1 done already, not run again) on 1 CPU core" in again.stdout
    assert [starts(folder, f"v={v}") for v in (1, 2, 3, 4)] == [1, 2, 1, 1]
    assert [r["status"] for r in summary_rows(folder)] == ["done"] * 4
    assert [r["name"] for r in summary_rows(folder)] == ["v=1", "v=2", "v=3", "v=4"]  # lowest val_loss first
    third = multigpu("sweep", *cmd, cwd=tmp_path)
    assert third.returncode == 0 and "nothing to do: all 4 runs are done" in third.stdout
    assert [starts(folder, f"v={v}") for v in (1, 2, 3, 4)] == [1, 2, 1, 1]


def test_two_sweeps_on_the_same_cores_never_share_one(tmp_path, recorder):
    env = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases"), "SLEEP": "0.7"}
    sweeps = [sweep_popen("--grid", "v=1,2,3", "--devices", "cpu:2", "--devices-per-run", "cpu:1",
                          "--out", f"sw{i}", "--", sys.executable, recorder, "{out}", "{v}",
                          cwd=tmp_path, env=env) for i in (1, 2)]
    for s in sweeps:
        out, _ = s.communicate(timeout=120)
        assert s.returncode == 0, out
    records = [json.loads(p.read_text()) for p in tmp_path.glob("sw*/runs/*/record.json")]
    assert len(records) == 6
    for i, (start, end, cores) in enumerate(records):
        assert len(cores) == 1
        for start2, end2, cores2 in records[i + 1:]:
            if cores == cores2:
                assert end <= start2 or end2 <= start, records


def test_detach_returns_at_once_and_the_sweep_completes(tmp_path, recorder):
    env = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases"), "SLEEP": "1"}
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "multigpu", "sweep", "--grid", "v=1,2",
                           "--devices-per-run", "cpu:1", "--max-parallel", "1", "--out", "sw",
                           "--detach", "--", sys.executable, recorder, "{out}", "{v}"],
                          cwd=tmp_path, env={**cli_env(), **env}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - began < 20
    assert "goes on in the background" in proc.stdout
    folder = tmp_path / "sw"
    deadline = time.time() + 60
    while time.time() < deadline and "finished:" not in (folder / "sweep.log").read_text():
        time.sleep(0.2)
    log = (folder / "sweep.log").read_text()
    assert "finished: 2 done, 0 failed" in log, log
    status = multigpu("sweep", "--status", "sw", cwd=tmp_path)
    assert "2 runs: 2 done; complete" in status.stdout, status.stdout
    assert "\nbest: v=1: val_loss 1" in status.stdout, status.stdout  # not "so far": it is over


def test_a_run_past_its_timeout_is_stopped_failed_and_retried(tmp_path, recorder):
    # 3 s: long enough for the recorder's Python to start on a loaded machine
    env = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases"), "SLEEP": "30"}
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "multigpu", "sweep", "--grid", "v=1",
                           "--devices-per-run", "cpu:1", "--timeout", "3s", "--retries", "1",
                           "--out", "sw", "--", sys.executable, recorder, "{out}", "{v}"],
                          cwd=tmp_path, env={**cli_env(), **env}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert time.monotonic() - began < 25  # SIGTERM ended each attempt, not the 30 s sleep
    state = json.loads((tmp_path / "sw" / "state" / "v=1.json").read_text())
    assert state["status"] == "failed" and state["attempts"] == 2
    assert [h["note"] for h in state["history"]] == ["timed out after 3s"] * 2
    assert state["note"] == "timed out after 3s"
    assert starts(tmp_path / "sw", "v=1") == 2
    assert "FAILED v=1" in proc.stdout and "retrying (1/1)" in proc.stdout


def test_a_metric_no_run_logs_is_said_with_the_nearest_name(tmp_path, recorder):
    """--metric val_los: each run's line says its metrics.jsonl has no such value and names the
    nearest (the summary ranks nothing), instead of ending 'done v=1 in 1s' without a word."""
    env = {"MULTIGPU_LEASE_DIR": str(tmp_path / "leases"), "SLEEP": "0"}
    proc = subprocess.run([sys.executable, "-m", "multigpu", "sweep", "--grid", "v=1,2",
                           "--devices-per-run", "cpu:1", "--max-parallel", "1", "--out", "sw",
                           "--metric", "val_los", "--", sys.executable, recorder, "{out}", "{v}"],
                          cwd=tmp_path, env={**cli_env(), **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = re.findall(r"\] done (v=\d) in \d+s(.*)\n", proc.stdout)
    assert said == [(f"v={v}", ": no val_los in its metrics.jsonl; did you mean --metric "
                                "val_loss?") for v in (1, 2)], proc.stdout
