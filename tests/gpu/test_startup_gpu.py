"""GPU tier for the start-up (train/head_start.py, train/rundir/timeline.py): on 2 GPUs, where CUDA and
NCCL start and torchvision is installed, a worker's thread imports the compiler's modules while the
group forms, then torchvision, the folder's listing and the compiler, and the run trains exactly
as one that does all of it in line (MULTIGPU_HEAD_START=0).

Run on a machine with 2 GPUs:  pytest -m gpu tests/gpu/test_startup_gpu.py
"""
import re
import subprocess
import sys

import pytest
import torch

from tests.gpu.conftest import gpu_env
from tests.gpu.test_decode_gpu import imagenet_like
from tests.multiproc.conftest import REPO

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _train(folder, out, head_start: str) -> str:
    env = gpu_env() | {"MULTIGPU_HEAD_START": head_start, "PYTHONPATH": str(REPO / "src")}
    argv = [sys.executable, "-m", "multigpu", "train", "--model", "resnet18", "--data",
            f"folder:{folder}", "--devices", "0,1", "--min-free-memory", "0", "--epochs", "1", "--batch-size", "4",
            "--image-size", "64", "--workers", "2", "--decode", "cpu", "--deterministic",
            "--seed", "3", "--out", str(out)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("time: ")]
    assert len(lines) == 1, done.stdout[-2000:]
    print(lines[0])
    return lines[0]


def test_two_gpus_on_folder_data_import_beside_the_group_and_train_as_in_line(tmp_path):
    folder = imagenet_like(tmp_path / "imgs")
    beside = _train(folder, tmp_path / "on", "1")
    in_line = _train(folder, tmp_path / "off", "0")
    parts = re.search(r"meanwhile in a thread: (.*)\), first step done at", beside)
    assert parts, beside
    assert [p.split(" ")[0] for p in parts.group(1).split(", ")] == \
        ["compiler's", "decoder", "folder", "compiler"], beside
    assert "meanwhile" not in in_line and "decoder " in in_line
    a = torch.load(tmp_path / "on" / "checkpoints" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "off" / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_the_launcher_of_a_two_gpu_run_never_starts_the_cuda_driver(tmp_path):
    """torchrun's LaunchConfig asks torch whether CUDA is available (for a NUMA default); asked
    the default way, that starts the CUDA driver in the launcher, which never uses CUDA: seconds
    of a start-up on some machines. NVML (libnvidia-ml) answers instead; libcuda stays unloaded."""
    import time

    env = gpu_env() | {"PYTHONPATH": str(REPO / "src")}
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    argv = [sys.executable, "-m", "multigpu", "train", "--model", "mlp", "--data", "digits",
            "--devices", "0,1", "--min-free-memory", "0", "--epochs", "3", "--out", str(tmp_path / "run")]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mapped, looks = set(), 0
    while proc.poll() is None:
        try:
            libs = {line.rsplit("/", 1)[-1] for line in open(f"/proc/{proc.pid}/maps") if ".so" in line}
        except OSError:
            break
        mapped |= {lib for lib in libs if lib.startswith(("libcuda.so", "libnvidia-ml.so"))}
        looks += 1
        time.sleep(0.1)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert looks > 10 and "epoch 3" in out, out[-2000:]
    assert not any(lib.startswith("libcuda.so") for lib in mapped), mapped
