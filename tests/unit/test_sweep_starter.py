"""Which runs a sweep forks from its warm process, and what that process may not do: ask CUDA
anything while it imports (a driver initialised before fork is unusable in the runs)."""
import subprocess
import sys
import textwrap

from multigpu.sweep import starter

PROBE = textwrap.dedent("""
    import torch
    calls = []
    def spy(name, real):
        def call(*a, **k):
            calls.append(name)
            return real(*a, **k)
        return call
    for name in ("is_available", "device_count", "init", "current_device", "get_device_properties"):
        setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))
    if hasattr(torch._C, "_cuda_getDeviceCount"):  # what initialises the driver
        torch._C._cuda_getDeviceCount = spy("_cuda_getDeviceCount", torch._C._cuda_getDeviceCount)
    from multigpu.cli.sweep import WARM_PRELOAD
    from multigpu.sweep.starter import SERVER_FIRST
    for name in (SERVER_FIRST, *WARM_PRELOAD):
        __import__(name)
    print(calls, torch.cuda.is_initialized())
    """)


def test_only_one_device_multigpu_train_runs_start_warm(monkeypatch):
    monkeypatch.delenv(starter.COLD_START_ENV, raising=False)
    train = [sys.executable, "-P", "-m", "multigpu", "train", "--model", "lstm"]
    assert starter.warm_args(train, 1) == ["train", "--model", "lstm"]
    assert starter.warm_args(train, 2) is None  # several processes: through the launcher
    assert starter.warm_args([sys.executable, "-P", "-m", "multigpu", "run", "x.py"], 1) is None
    assert starter.warm_args(["python3", "train.py"], 1) is None
    monkeypatch.setenv(starter.COLD_START_ENV, "1")
    assert starter.warm_args(train, 1) is None


def test_the_warm_imports_ask_cuda_nothing():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[] False"
