"""GPU tier of `multigpu doctor` and `--batch-size auto`: peak memory, the batch that fits, and
the size auto picks, agreed by every rank and kept by a resumed run.

Run there with:  pytest -m gpu tests/gpu/test_doctor_gpu.py
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.gpu.conftest import gpu_env

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

MODEL = ["--model", "resnet18", "--data", "synthetic:3000", "--image-size", "96"]


def cli(*args, cwd, timeout=400):
    return subprocess.run([sys.executable, "-m", "multigpu", *map(str, args)], cwd=cwd,
                          env=gpu_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.cuda_here  # reads the GPU's size here
def test_doctor_measures_peak_memory_and_the_largest_batch_that_fits(tmp_path):
    proc = cli("doctor", *MODEL, "--devices", "1", "--batch-size", "64", "--precision", "bf16", cwd=tmp_path)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    memory = next(line for line in proc.stdout.splitlines() if "  memory  " in line)
    said = re.search(r"([\d.]+) GiB in a training step, ([\d.]+) GiB in evaluation", memory)
    train, evaluation = map(float, said.groups())
    assert 0 < evaluation < train
    fit = next(line for line in proc.stdout.splitlines() if "batch fit" in line)
    largest = int(re.search(r"fits on cuda:\d+: (\d+) \(peak", fit).group(1))
    assert largest > 64
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    peak = float(re.search(r"peak ([\d.]+) of", fit).group(1))
    assert peak <= 0.9 * total + 0.1


def test_batch_size_auto_trains_with_one_size_on_every_rank_and_a_resume_keeps_it(tmp_path):
    gpus = min(torch.cuda.device_count(), 2)
    args = [*MODEL, "--epochs", "1", "--batch-size", "auto", "--precision", "bf16",
            "--devices", str(gpus), "--out", "run", "--checkpoint-every", "0"]
    first = cli("train", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    said = re.search(r"--batch-size auto: (\d+) per GPU, the largest that fits on every GPU",
                     first.stdout + first.stderr)
    assert said, first.stdout[-2000:]
    size = int(said.group(1))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["batch_size"] == size and config["global_batch"] == size * gpus
    longer = list(args)
    longer[longer.index("--epochs") + 1] = "2"
    again = cli("train", *longer, "--resume", "run", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"--batch-size auto: {size} per GPU, the size this run has trained with" in again.stdout + again.stderr


def test_an_out_of_memory_run_ends_with_the_gpu_its_memory_and_the_fixes(tmp_path):
    proc = cli("train", "--model", "resnet50", "--data", "synthetic:4100", "--batch-size", "4096",
               "--devices", "1", "--precision", "bf16", "--epochs", "1", "--out", "oom", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.match(r"multigpu: error: CUDA out of memory on cuda:0 \(\d+ GiB: this run's peak [\d.]+ GiB, "
                    r"other processes [\d.]+ GiB\) with --batch-size 4096 per GPU", last), last
    assert "--batch-size auto" in last and "--batch-size 2048" in last
    assert "Traceback" not in proc.stderr


GPU_SCRIPT = """\
import os
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
held = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 0.25 GiB on each rank's GPU
model = DDP(nn.Linear(64, 8).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(100):
    model(torch.randn(32, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
open("finished.txt", "w").write("done")
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_doctor_runs_a_script_on_two_gpus_and_names_each_ranks_peak_memory(tmp_path):
    (tmp_path / "train.py").write_text(GPU_SCRIPT)
    proc = cli("doctor", "--devices", "2", "--min-free-memory", "0", "--", "train.py", cwd=tmp_path)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    memory = next(line for line in proc.stdout.splitlines() if line.startswith("ok    memory"))
    peaks = re.findall(r"rank (\d) ([\d.]+) of \d+ GiB on GPU (\d)", memory)
    assert [(r, g) for r, _, g in peaks] == [("0", "0"), ("1", "1")], memory
    assert all(float(p) >= 0.25 for _, p, _ in peaks), memory
    assert "ran on 2 ranks up to optimizer step 1" in proc.stdout
    assert not (tmp_path / "finished.txt").exists()
