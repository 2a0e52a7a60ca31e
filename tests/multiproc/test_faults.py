"""Fault injection: kill anything at any moment; a resumed run ends with the same weights, bit for
bit, as one never interrupted, and no checkpoint is ever lost.

Every fault is caused for real (kill -9, SIGTERM, a truncated file, a file size limit standing in
for a full disk) on `multigpu train` runs of 2 CPU processes (gloo) through the real launcher.
The random moments come from a seeded generator; its draws are in the assertion messages.
"""
import contextlib
import csv
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from multigpu.train.checkpoints.checkpoint_store import CheckpointStore
from multigpu.core.system.fileio import sha256_file
from tests.unit.test_loggers import scalars

from .conftest import cli_env, multigpu, read_metrics, track

pytestmark = pytest.mark.slow

N = 6000  # samples: 188 steps of 32 per epoch, about 2 s an epoch here
ARGS = ["--model", "mlp", "--data", f"synthetic:{N}", "--epochs", "3", "--batch-size", "16",
        "--optimizer", "sgd", "--lr", "0.05", "--workers", "0", "--seed", "4",
        "--checkpoint-every", "40", "--deterministic"]


def start(out: Path, *extra, devices="cpu:2", preexec_fn=None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "multigpu", "train", *ARGS, "--devices", devices,
                             "--out", str(out), *map(str, extra)], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec_fn)
    track(proc)
    return proc


def finish(proc: subprocess.Popen, timeout=240) -> tuple[str, str]:
    return proc.communicate(timeout=timeout)


def weights(out: Path) -> dict:
    return torch.load(out / "checkpoints" / "last.pt", weights_only=True)["model"]


def assert_same_weights(a: Path, b: Path, why: str = "") -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{why}: not bit-identical: {different}"


def workers_of(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in kids:
        try:
            # a worker has its rank in its environment; a child forked but not yet exec'd
            # shows the launcher's command line and environment, and is not one
            if p.status() != psutil.STATUS_ZOMBIE and "LOCAL_RANK" in p.environ():
                found.append(p)
        except psutil.Error:  # gone while we looked
            pass
    return found


def wait_for_new_workers(proc: subprocess.Popen, dead: set[int], timeout=120) -> list[psutil.Process]:
    """The two workers of a new attempt (none of whose pids is in `dead`)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before the fault"
        workers = [w for w in workers_of(proc) if w.pid not in dead]
        if len(workers) == 2:
            return workers
        time.sleep(0.05)
    raise AssertionError("no new workers in time")


def wait_for_checkpoint(out: Path, proc: subprocess.Popen, newer_than: int = -1, timeout=120) -> int:
    """The newest complete checkpoint's step, once there is one newer than `newer_than`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before the fault"
        try:
            entries = CheckpointStore(out / "checkpoints").entries()
        except Exception:  # mid-rename: look again
            entries = []
        if entries and entries[-1].global_step > newer_than:
            return entries[-1].global_step
        time.sleep(0.05)
    raise AssertionError("no new checkpoint in time")


def check_epochs(out: Path) -> None:
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == [1, 2, 3], "every epoch exactly once"
    assert all(r["train_samples"] == N for r in records)
    # the logs too: every logged step once, in order (50, 100, ... up to 3 x 188 steps)
    expected = list(range(50, 3 * 188 + 1, 50))
    with open(out / "steps.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == expected
    seen = scalars(out)
    assert [s for s, _ in seen["train/loss"]] == expected
    assert [s for s, _ in seen["val/loss"]] == [188, 376, 564]
    with open(out / "metrics.csv", newline="") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2, 3]


def train_uninterrupted(out: Path) -> Path:
    """The 2-process run of ARGS, never interrupted: conftest's faults_reference, launched once a
    session for this module and test_requeue."""
    proc = multigpu("train", *ARGS, "--devices", "cpu:2", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_epochs(out)
    return out


@pytest.fixture(scope="module")
def reference(faults_reference) -> Path:
    return faults_reference


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, reference) -> tuple[Path, str]:
    """A run stopped by SIGTERM to its launcher, at a random moment after its first checkpoint."""
    out = tmp_path_factory.mktemp("faults") / "sigterm"
    proc = start(out)
    first = wait_for_checkpoint(out, proc)
    delay = random.Random(7).uniform(0.0, 1.0)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    return out, stdout + stderr + f"\n(first checkpoint at step {first}, SIGTERM {delay:.2f} s later)"


@pytest.mark.smoke
def test_sigterm_writes_a_checkpoint_and_the_same_command_with_resume_ends_equal(stopped, reference, tmp_path):
    folder, output = stopped
    assert ("SIGTERM: the ranks stop together at their next exchange (about a second of steps), "
            "then save a checkpoint") in output
    assert re.search(r"stopped by SIGTERM (in epoch \d+, \d+ samples in|after epoch \d+), step \d+: checkpoint ",
                     output) and "is complete; run the same command with --resume" in output
    assert "Received 15 death signal" not in output
    # rank 0 said where it stopped and how to go on: the launcher does not add a line of its own
    assert "every rank of this node was stopped" not in output, output[-3000:]
    out = tmp_path / "run"
    shutil.copytree(folder, out)
    proc = start(out, "--resume", out)
    stdout, stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout
    check_epochs(out)
    assert_same_weights(reference, out, output[-200:])


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGUSR1, marks=pytest.mark.extended)])
def test_sigterm_to_every_process_of_a_run_with_loader_workers_stops_it_with_a_checkpoint(tmp_path, sig):
    """As `pkill -f`, SLURM's scancel or time limit and systemd's stop send it (SIGUSR1: SLURM's
    --signal without B:): the signal to the launcher, every rank and every loader worker at once.
    The workers outlive it (the ranks end them), each rank takes its own and the launcher's copy
    as one stop, and the run stops with a checkpoint, as after a signal to the launcher alone; the
    same command resumes it."""
    out = tmp_path / "run"
    proc = start(out, "--workers", "1")
    first = wait_for_checkpoint(out, proc)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len(tree) >= 5, [p.name() for p in tree]  # the launcher, 2 ranks, a worker each
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
    stdout, stderr = finish(proc)
    output = stdout + stderr
    assert proc.returncode == 128 + sig, output[-3000:]
    stopped = re.search(rf"stopped by {sig.name} (?:in epoch \d+, \d+ samples in|after epoch \d+), step (\d+): "
                        r"checkpoint \S+ is complete", output)
    assert stopped and int(stopped.group(1)) >= first, output[-3000:]
    for said in ("Traceback", "killed by signal", "again: stopping at once", "every rank of this node was stopped"):
        assert said not in output, output[-3000:]
    resumed = start(out, "--workers", "1", "--resume", out)
    stdout, stderr = finish(resumed)
    assert resumed.returncode == 0, stderr[-3000:]
    check_epochs(out)


@pytest.mark.parametrize("devices", [pytest.param("cpu:1", marks=pytest.mark.extended), "cpu:3"])
def test_resume_inside_an_epoch_on_another_process_count_trains_each_sample_once(reference, tmp_path, devices):
    inside = [e for e in CheckpointStore(reference / "checkpoints").entries() if e.run["position"]]
    assert inside, "the reference keeps a checkpoint from inside its last epoch"
    entry = inside[-1]
    out = tmp_path / "run"
    proc = start(out, "--resume", reference / "checkpoints" / entry.file, devices=devices)
    stdout, stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"{entry.run['position']} of {N} samples in" in stdout
    assert "skipped" not in stderr
    # the resumed epoch counts N samples over 2 then 1 or 3 processes: none twice, none left out
    assert [(r["epoch"], r["train_samples"]) for r in read_metrics(out)] == [(3, N)]


@pytest.mark.extended  # about 12 s on 2 cores: CI runs it (make test-all)
def test_kill_9_of_a_worker_at_random_moments_restarts_and_ends_equal(reference, tmp_path):
    out = tmp_path / "killed"
    rng = random.Random(3)
    proc = start(out, "--max-restarts", "3")
    kills, dead = [], set()
    for _ in range(2):
        victims = wait_for_new_workers(proc, dead)
        newest = CheckpointStore(out / "checkpoints").entries()
        step = wait_for_checkpoint(out, proc, newer_than=newest[-1].global_step if newest else -1)
        delay = rng.uniform(0.0, 1.5)  # this attempt has saved once: kill it somewhere after
        time.sleep(delay)
        victim = rng.choice(victims)
        victim.kill()
        kills.append(f"after step {step} +{delay:.2f} s")
        dead |= {v.pid for v in victims}
    stdout, stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.count("resumed from") == 2, (kills, stdout[-2000:])
    for k in (1, 2):  # each restart says so, and where the failed attempt's output is
        said = [line for line in stderr.splitlines() if line.startswith(f"multigpu: warning: restart {k} of 3 ")]
        assert said and "the previous attempt failed" in said[0] and said[0].endswith(
            f"the output and errors of this node's ranks in it: "
            f"{next((out / 'logs').glob(f'*/attempt_{k - 1}'))}"), stderr[-3000:]
    check_epochs(out)
    assert_same_weights(reference, out, f"kills {kills}")


@pytest.mark.parametrize("who, sig", [("launcher", signal.SIGINT), ("rank 0", signal.SIGKILL)])
def test_a_signal_while_the_finished_ranks_exit_is_a_finished_run_but_a_rank_s_death_is_not(
        tmp_path, who, sig):
    """A signal as soon as rank 0 printed its time: line (every epoch and the last checkpoint
    done; the ranks only exiting). Ctrl-C to the launcher: exit 0 and the run's end said, not
    "stopped". A rank killed then (the OOM killer's SIGKILL) still fails the launch: 137."""
    out = tmp_path / "run"
    proc = start(out, "--epochs", "1")
    for line in proc.stdout:
        if line.startswith("time: "):
            target = psutil.Process(proc.pid) if who == "launcher" else next(
                w for w in workers_of(proc) if w.environ().get("RANK") == "0")
            target.send_signal(sig)
            break
    else:
        pytest.fail("no time: line")
    stdout, stderr = finish(proc)
    said = ("multigpu train: the run had finished before the signal (1 epochs trained, "
            f"{out / 'checkpoints' / 'step-000000188.pt'} complete): exit 0")
    if who == "launcher":
        assert proc.returncode == 0 and said in stdout, stdout + stderr
    else:
        assert proc.returncode == 128 + signal.SIGKILL and said not in stdout, stdout + stderr
        assert "rank 0 failed first (signal SIGKILL" in stderr
    assert [m["epoch"] for m in read_metrics(out)] == [1]


def test_kill_9_the_moment_an_epoch_s_checkpoint_is_complete_loses_none_of_its_logs(reference, tmp_path):
    """The end of epoch 1's checkpoint (step 188) complete, rank 0 killed at once: the restart
    resumes from it, and the epoch's scalars were logged before it (TensorBoard keeps every point
    up to the step it resumes from), so every epoch's val/loss is there once."""
    out = tmp_path / "killed"
    proc = start(out, "--max-restarts", "1", "--checkpoint-every", "0")  # epoch ends only
    assert wait_for_checkpoint(out, proc) == 188
    next(w for w in workers_of(proc) if w.environ().get("RANK") == "0").kill()
    stdout, stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout and "(after epoch 1, step 188;" in stdout, stdout[-2000:]
    check_epochs(out)


@pytest.mark.smoke
def test_a_crash_without_restarts_names_the_rank_and_keeps_the_logs_it_points_at(tmp_path):
    # Killed mid-training, as by the OOM killer: the other rank then fails on the lost
    # connection (the echo); the report blames the killed one.
    out = tmp_path / "crashed"
    proc = start(out, "--max-restarts", "0")
    victim = wait_for_new_workers(proc, set())[1]
    wait_for_checkpoint(out, proc)
    victim.kill()
    _, stderr = finish(proc)
    assert proc.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    blamed = [line for line in stderr.splitlines() if "failed first" in line]
    assert blamed and "(signal SIGKILL" in blamed[0] and f"pid {victim.pid})" in blamed[0], stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("multigpu: logs of every rank: ")]
    assert said and list(Path(said[0].split(": ", 2)[2]).glob("*/attempt_0/*/stderr.log")), stderr[-3000:]
    assert "Traceback" not in stderr, stderr  # rank 0's echo of the lost peer: in its error file only


def test_kill_9_of_the_launcher_workers_save_and_stop_then_resume_ends_equal(reference, tmp_path):
    out = tmp_path / "orphaned"
    rng = random.Random(5)
    # On one CPU: the whole run then lasts about 4 s here, well past the workers' noticing (within
    # POLL_SECONDS) and agreeing (within control.CHECK_SECONDS), even on a machine twice as fast.
    proc = start(out, preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    workers = wait_for_new_workers(proc, set())
    step = wait_for_checkpoint(out, proc)
    delay = rng.uniform(0.0, 0.5)
    time.sleep(delay)
    proc.kill()  # the launcher, as the OOM killer or a careless kill -9 would
    proc.wait()
    # They notice within POLL_SECONDS and agree within control.CHECK_SECONDS, then save; their
    # exit (rank 0 draws curves.png, torch tears down) takes seconds more on a loaded machine.
    # Under watchdog.ORPHAN_GRACE_SECONDS (30 s), after which they would be made to exit unsaved.
    _, alive = psutil.wait_procs(workers, timeout=25)
    assert not alive, "workers went on without their launcher"
    log = "".join(p.read_text() for p in out.glob("logs/*/attempt_0/1/stderr.log"))
    assert "the launcher" in log and "is gone" in log and "is complete" in log, log[-2000:]
    resumed = start(out, "--resume", out)
    stdout, stderr = finish(resumed)
    assert resumed.returncode == 0, stderr[-3000:]
    check_epochs(out)
    assert_same_weights(reference, out, f"launcher killed {delay:.2f} s after step {step}")


def test_a_truncated_newest_checkpoint_is_reported_and_the_one_before_used(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    newest = CheckpointStore(out / "checkpoints").entries()[-1]
    path = out / "checkpoints" / newest.file
    # one file under each of its names in the run (copytree made them copies)
    for name in (path, out / "checkpoints" / "last.pt", out / "checkpoints" / "best.pt"):
        if sha256_file(name) == newest.sha256:
            with open(name, "r+b") as f:
                f.truncate(newest.size // 3)
    proc = start(out, "--resume", out)
    stdout, stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"checkpoint {path} is damaged" in stderr and "trying the one before it" in stderr
    check_epochs(out)
    assert_same_weights(reference, out, "after the fallback")  # epoch 3's end trained again


def _file_size_limit():
    # Files may not grow past 200 KB (the checkpoints are ~650 KB): a write beyond fails with
    # EFBIG, as one on a full disk fails with ENOSPC.
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


def test_a_full_disk_stops_the_run_with_one_clear_line_and_the_checkpoints_stay_intact(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = CheckpointStore(out / "checkpoints").entries()
    proc = start(out, "--resume", out, "--epochs", "4", preexec_fn=_file_size_limit)
    stdout, stderr = finish(proc)
    assert proc.returncode == 2, stderr[-3000:]
    # a failed write names no file: the line says no "(None)" for it
    assert (f"saving a checkpoint to {out / 'checkpoints'} failed: File too large; the last complete "
            f"checkpoint, {out / 'checkpoints' / before[-1].file}, is intact") in stderr, stderr[-3000:]
    assert "Traceback" not in stderr.split("failed first")[0]
    store = CheckpointStore(out / "checkpoints")
    assert store.entries() == before
    state, _ = store.load_newest(lambda w: pytest.fail(w))
    assert state["run"]["epoch"] == 4


@pytest.fixture(scope="module")
def reference_fsdp(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "uninterrupted-fsdp"
    proc = multigpu("train", *ARGS, "--devices", "cpu:2", "--strategy", "fsdp", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_epochs(out)
    return out


def exported_weights(out: Path) -> dict:
    """The model of a run's newest checkpoint, its shards gathered by `multigpu export`."""
    proc = multigpu("export", out, "--out", out / "exported.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "exported.pt", weights_only=True)["model"]


@pytest.mark.extended  # the ddp case stays in the default tier
def test_kill_9_of_a_worker_under_fsdp_restarts_from_the_shards_and_ends_equal(reference_fsdp, tmp_path):
    # every rank writes its own shards: a kill at a random moment may fall inside that write
    out = tmp_path / "killed"
    rng = random.Random(5)
    proc = start(out, "--strategy", "fsdp", "--max-restarts", "3")
    victims = wait_for_new_workers(proc, set())
    step = wait_for_checkpoint(out, proc)
    delay = rng.uniform(0.0, 1.5)
    time.sleep(delay)
    rng.choice(victims).kill()
    stdout, stderr = finish(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert stdout.count("resumed from") == 1, (step, delay, stdout[-2000:])
    check_epochs(out)
    assert not list((out / "checkpoints").glob(".*.tmp")), "no temporary shard folder left"
    a, b = exported_weights(reference_fsdp), exported_weights(out)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not different, f"kill after step {step} +{delay:.2f} s"


def test_a_full_disk_under_fsdp_is_one_clear_line_and_the_shards_before_stay_intact(reference_fsdp, tmp_path):
    # every rank writes its shards through torch.distributed.checkpoint, whose failure holds
    # each rank's error: the user reads the first one, as under ddp
    out = tmp_path / "run"
    shutil.copytree(reference_fsdp, out)
    before = CheckpointStore(out / "checkpoints").entries()
    proc = start(out, "--strategy", "fsdp", "--resume", out, "--epochs", "4", preexec_fn=_file_size_limit)
    stdout, stderr = finish(proc)
    assert proc.returncode == 2, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("multigpu: error: ")]
    assert said and said[0].startswith(f"multigpu: error: saving a checkpoint to {out / 'checkpoints'} "
                                       "failed: "), stderr[-3000:]
    # torch.save's zip writer loses the errno of a short write (EFBIG here, ENOSPC on a full disk)
    assert "rank 0: its shard file was written short ([enforce fail" in said[0], said[0]
    assert "as on a full disk or past a file size limit; " in said[0] and " GiB free there now" in said[0]
    assert f"the last complete checkpoint, {out / 'checkpoints' / before[-1].file}, is intact" in said[0]
    assert "Traceback" not in stderr.split("failed first")[0]
    assert CheckpointStore(out / "checkpoints").entries() == before
    assert not list((out / "checkpoints").glob(".*.tmp")), "no temporary shard folder left"
