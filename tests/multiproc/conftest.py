"""Helpers for tests that run the real `multigpu` command in subprocesses (gloo on CPU)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

# A rule of our own GPU machines (NVLink SHARP / multicast off), not of the product: every command
# our tests and benchmarks start sets it (see also the Makefile's test-gpu, benchmarks/*.sh).
GPU_MACHINE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}


def cli_env() -> dict:
    env = dict(os.environ)
    env.update(GPU_MACHINE_ENV, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def multigpu(*args, cwd=None, timeout=240) -> subprocess.CompletedProcess:
    """Run `python -m multigpu ARGS` and return the finished process (text output)."""
    return subprocess.run([sys.executable, "-m", "multigpu", *map(str, args)], cwd=cwd,
                          env=cli_env(), capture_output=True, text=True, timeout=timeout)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


_STARTED: list[psutil.Process] = []


def suspend(proc: psutil.Process) -> None:
    """SIGSTOP `proc` and wait until it is stopped: the stop takes effect only when the process is
    next scheduled, and a signal sent to it before then (SIGINT, SIGTERM: lower numbers) is taken
    first, not left pending."""
    proc.suspend()
    while proc.status() != psutil.STATUS_STOPPED:
        time.sleep(0.01)


def track(proc: subprocess.Popen) -> None:
    """Kill the process `proc` started (a launcher) with every child of it after the test, so a
    test that fails leaves no workers behind for the next ones (_no_process_left_behind)."""
    _STARTED.append(psutil.Process(proc.pid))


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    yield
    for p in _STARTED:
        try:
            for q in [p, *p.children(recursive=True)]:
                q.kill()
        except psutil.Error:
            pass
    _STARTED.clear()


@pytest.fixture
def procs():
    """Popen objects started by a test; whatever is left is killed, with its children."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            kids = psutil.Process(p.pid).children(recursive=True)
            for q in [p, *kids]:
                try:
                    q.kill()
                except (psutil.NoSuchProcess, ProcessLookupError):
                    pass
            p.wait(10)


@pytest.fixture
def run_cli():
    return multigpu


# Runs that two modules compare with, launched once a session rather than once per module (each is
# read, never changed: a test that resumes from one writes into a folder of its own).
@pytest.fixture(scope="session")
def faults_reference(tmp_path_factory) -> Path:
    """test_faults' 2-process run never interrupted, the reference of test_requeue too."""
    from .test_faults import train_uninterrupted

    return train_uninterrupted(tmp_path_factory.mktemp("faults") / "uninterrupted")


@pytest.fixture(scope="session")
def global_batch_on_2(tmp_path_factory) -> tuple[Path, str]:
    """test_global_batch's run on 2 processes (its folder, what it said), test_lost_device's
    reference too."""
    from .test_global_batch import train

    out = tmp_path_factory.mktemp("global") / "cpu2"
    proc = train(out, 2)
    return out, proc.stdout + proc.stderr
