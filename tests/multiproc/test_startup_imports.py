"""What the processes of a `multigpu train` launch import: each only what its run uses.

A real 2-process launch: the launcher dumps its sys.modules at exit (the probe below runs the CLI
as `python -m multigpu` does); rank 1 is a worker like any other, and Python lists its imports
(PYTHONPROFILEIMPORTTIME, inherited) in its log: every module an import statement loaded. Rank 0 is
left out: it alone writes the logs (tensorboard) and curves.png (matplotlib). Speed is measured by
benchmarks/startup_phases.py.
"""
import importlib.util
import json
import subprocess
import sys

import pytest

from .conftest import cli_env

pytestmark = pytest.mark.slow

# Packages no run below uses (torchvision: only folder: data, where it is installed). Not triton:
# torch._dynamo tries it (the log lists a try that failed too).
UNUSED = ("torchvision", "matplotlib", "tensorboard", "PIL", "timm", "pandas", "sklearn", "mlflow",
          "wandb")
# Modules only a worker needs: the launcher has torch for torchrun's agent, and nothing of these
WORKERS_ONLY = ("multigpu.train.trainloop", "multigpu.train.training", "multigpu.train.models.catalog",
                "multigpu.train.checkpoints.checkpoint_store", "multigpu.train.checkpoints.runstate",
                "multigpu.core.checkpoints.checkpoint", "multigpu.core.runtime",
                "multigpu.core.process_runtime", "torch._dynamo",
                "torch.distributed.checkpoint")

LAUNCHER = """
import atexit, json, sys
atexit.register(lambda: print("MODULES " + json.dumps(sorted(sys.modules)), flush=True))
from multigpu.cli import main
sys.exit(main())
"""


def _launch(tmp_path, data: str, model: str) -> tuple[set, set]:
    """(the launcher's modules, the top-level packages and modules rank 1 imported)."""
    out = tmp_path / "run"
    env = dict(cli_env(), PYTHONPROFILEIMPORTTIME="1")
    argv = [sys.executable, "-c", LAUNCHER, "train", "--model", model, "--data", data,
            "--devices", "cpu:2", "--epochs", "1", "--batch-size", "4", "--workers", "0",
            "--image-size", "16", "--out", str(out)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    launcher = set(json.loads(done.stdout.split("MODULES ")[-1]))
    logs = list(out.glob("logs/*/attempt_0/1/stderr.log"))
    assert len(logs) == 1, list(out.rglob("*"))
    rank1 = {line.split("|")[2].strip() for line in logs[0].read_text().splitlines()
             if line.startswith("import time:") and line.count("|") == 2}
    assert "torch" in rank1 and "multigpu.train.trainloop" in rank1  # the listing is read right
    return launcher, rank1


def _tops(modules: set) -> set:
    return {m.split(".")[0] for m in modules} | set(modules)


def test_a_synthetic_run_imports_no_image_library_and_its_launcher_no_worker_module(tmp_path):
    launcher, rank1 = _launch(tmp_path, "synthetic:32", "mlp")
    assert sorted(_tops(rank1) & set(UNUSED)) == []
    # DDP's constructor needs the compiler (head_start imports it early, by importlib, whose
    # first module the log leaves out: its submodules are there)
    assert any(m.startswith("torch._dynamo.") for m in rank1)
    assert sorted(_tops(launcher) & {*UNUSED, *WORKERS_ONLY}) == []


def test_a_folder_run_imports_its_decoders_and_nothing_else_unused(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / "imgs" / split / cls).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (20, 20), (60 * i, 0, 0)).save(tmp_path / "imgs" / split / cls / f"{i}.jpg")
    launcher, rank1 = _launch(tmp_path, f"folder:{tmp_path / 'imgs'}", "cnn")
    decoders = {"PIL"} | ({"torchvision"} if importlib.util.find_spec("torchvision") else set())
    assert decoders <= _tops(rank1)
    # (torchvision is tried where it is not installed: the log lists the try)
    assert sorted(_tops(rank1) & (set(UNUSED) - {"PIL", "torchvision"})) == []
    assert sorted(_tops(launcher) & {*UNUSED, *WORKERS_ONLY}) == []
