"""A lost device: go on without it (--max-restarts 1 --min-devices M --device-health CMD).

Every fault is real: rank 1 of a 3-process `multigpu train` is killed with -9 after the run's
first checkpoint, and the site's health command (a shell script here) names cpu:1 only once the
process of rank 1 is really gone (`kill -0` of its pid fails: the launcher has reaped it). The run
then goes on on cpu:0 and cpu:2 from the newest checkpoint, at the same --global-batch-size, and
ends with the weights of a 2-process run never interrupted, within test_global_batch's tolerance
(1e-6: the same sums in another order; its docstring says why).
"""
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from multigpu.train.checkpoints.checkpoint_store import CheckpointStore

from .conftest import cli_env, read_metrics, track
from .test_global_batch import ARGS, MADE, N, TOLERANCE, largest_difference

pytestmark = pytest.mark.slow

HEALTH = """#!/bin/sh
# a site's health check: cpu:1 is unhealthy once the process of rank 1 is gone
pid=$(cat "{victim}" 2>/dev/null) || exit 0
if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then echo {says}; fi
"""


def health_script(tmp_path: Path, says: str = "cpu:1", body: str | None = None) -> tuple[str, Path]:
    victim = tmp_path / "victim.pid"
    script = tmp_path / "health.sh"
    script.write_text(body or HEALTH.format(victim=victim, says=says))
    script.chmod(0o755)
    return str(script), victim


def start(out: Path, devices: int, *extra) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "multigpu", "train", *ARGS, "--devices",
                             f"cpu:{devices}", "--out", str(out), *map(str, extra)], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    track(proc)
    return proc


def kill_rank_1_after_a_checkpoint(proc: subprocess.Popen, out: Path, victim: Path) -> int:
    """kill -9 of rank 1 once the run has a checkpoint; its pid written where the health script
    looks. The pid killed."""
    deadline = time.time() + 180
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before the kill"
        try:
            entries = CheckpointStore(out / "checkpoints").entries()
        except Exception:  # mid-rename: look again
            entries = []
        if entries:
            break
        time.sleep(0.05)
    rank1 = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                 if p.environ().get("RANK") == "1")
    victim.write_text(str(rank1.pid))
    rank1.kill()
    return rank1.pid


def ranks_of_attempt(out: Path, attempt: int) -> list[str]:
    return sorted(p.name for p in next((out / "logs").glob(f"*/attempt_{attempt}")).iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def reference(global_batch_on_2) -> Path:
    """The same run on 2 processes, never interrupted (test_global_batch's, once a session)."""
    return global_batch_on_2[0]


def test_a_rank_killed_on_a_device_named_unhealthy_goes_on_without_it_and_ends_equal(reference, tmp_path):
    cmd, victim = health_script(tmp_path)
    out = tmp_path / "run"
    proc = start(out, 3, "--max-restarts", 1, "--min-devices", 2, "--device-health", cmd)
    pid = kill_rank_1_after_a_checkpoint(proc, out, victim)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert (f"multigpu: warning: rank 1 (pid {pid}) was killed by SIGKILL; cpu:1 is unhealthy "
            f"(--device-health {cmd}): dropped; restarting on the 2 healthy devices (cpu:0, cpu:2) "
            f"from the newest checkpoint (restart 1 of 1); --global-batch-size 24 kept: {MADE[2]}"
            in stderr), stderr[-3000:]
    assert ranks_of_attempt(out, 0) == ["0", "1", "2"] and ranks_of_attempt(out, 1) == ["0", "1"]
    assert "ddp (2 processes, gloo)" in stdout and "resumed from" in stdout
    assert f"--global-batch-size 24 kept: {MADE[2]} (saved as {MADE[3]})" in stdout, stdout[-3000:]
    assert [(r["epoch"], r["train_samples"]) for r in read_metrics(out)] == [(1, N), (2, N)]
    assert largest_difference(reference, out) < TOLERANCE
    closing = stderr.strip().splitlines()[-1]
    said = re.fullmatch(r"multigpu: recovery: restart 1 \(cpu:1 dropped: on 2 devices\): ([\d.]+) s "
                        r"from the failure to the first resumed step; (\d+) steps? trained twice "
                        r"\((\d+) samples trained before the failure past the checkpoint resumed from\)",
                        closing)
    assert said, stderr[-3000:]
    seconds, twice, samples = float(said[1]), int(said[2]), int(said[3])
    # --checkpoint-every 10 (batches): 5 optimizer steps of 24 on 3 processes between checkpoints
    assert 0 < seconds < 300 and samples == 24 * twice and twice <= 5


def test_a_rank_killed_on_a_healthy_device_restarts_on_the_same_devices(tmp_path):
    cmd, victim = health_script(tmp_path, says="")  # a crash of the program: no device named
    out = tmp_path / "run"
    proc = start(out, 3, "--max-restarts", 1, "--min-devices", 2, "--device-health", cmd)
    pid = kill_rank_1_after_a_checkpoint(proc, out, victim)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert (f"multigpu: warning: rank 1 (pid {pid}) was killed by SIGKILL; restarting all workers "
            "(restart 1 of 1)\n" in stderr), stderr[-3000:]
    assert ranks_of_attempt(out, 1) == ["0", "1", "2"]
    assert re.search(r"\nmultigpu: recovery: restart 1: [\d.]+ s from the failure", stderr), stderr[-3000:]


def test_fewer_healthy_devices_than_min_devices_stop_in_one_line(tmp_path):
    cmd, victim = health_script(tmp_path)
    out = tmp_path / "run"
    proc = start(out, 3, "--max-restarts", 1, "--min-devices", 3, "--device-health", cmd)
    kill_rank_1_after_a_checkpoint(proc, out, victim)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 137, stderr[-3000:]
    assert (f"multigpu: error: cpu:1 is unhealthy (--device-health {cmd}): 2 healthy devices left "
            "(cpu:0, cpu:2), fewer than --min-devices 3; not restarted\n" in stderr), stderr[-3000:]
    assert "restart 1 of 1" not in stderr
    assert not list((out / "logs").glob("*/attempt_1"))


def test_a_health_command_that_fails_warns_and_restarts_on_the_same_devices(tmp_path):
    cmd, victim = health_script(tmp_path, body="#!/bin/sh\necho 'nvidia-smi: not found' >&2\nexit 3\n")
    out = tmp_path / "run"
    proc = start(out, 3, "--max-restarts", 1, "--min-devices", 2, "--device-health", cmd)
    kill_rank_1_after_a_checkpoint(proc, out, victim)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert (f"multigpu: warning: --device-health {cmd}: exit code 3 (nvidia-smi: not found); taken "
            "as naming no device\n" in stderr), stderr[-3000:]
    assert "; restarting all workers (restart 1 of 1)" in stderr
    assert ranks_of_attempt(out, 1) == ["0", "1", "2"]


def test_one_device_with_max_restarts_trains_in_a_rank_that_restarts(tmp_path):
    """--devices cpu:1 --max-restarts 1: the rank is a process of the launcher's, so its kill -9
    restarts it (before, one device trained in the launcher's own process: nothing to restart,
    and --max-restarts, --min-devices and --device-health were silently without effect)."""
    out = tmp_path / "run"
    proc = start(out, 1, "--max-restarts", 1)
    deadline = time.time() + 180
    while time.time() < deadline and not list((out / "checkpoints").glob("step-*.pt")):
        assert proc.poll() is None, "the run ended before the kill"
        time.sleep(0.05)
    rank = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                if p.environ().get("RANK") == "0")
    rank.kill()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert (f"multigpu: warning: rank 0 (pid {rank.pid}) was killed by SIGKILL; restarting all "
            "workers (restart 1 of 1)\n" in stderr), stderr[-3000:]
    assert re.search(r"\nmultigpu: recovery: restart 1: [\d.]+ s from the failure", stderr), stderr[-3000:]
