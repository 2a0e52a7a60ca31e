"""--decode auto times each way in the job and keeps the fastest (decode_choice), on 2 gloo
processes, with the GPU path's CPU stand-in (PIL decodes, the crops in torch)."""
import json
import re
import shutil

import numpy as np
import pytest
import torch

from .conftest import multigpu, read_metrics

TRAIN = 208  # 104 steps of 2 samples (1 per rank): the trial's 100 fit in the first epoch


def _folder(root):
    """Large smooth photos (4.3 MP): the stand-in crops them in dense matrix products, about 4x
    a worker's decode and crop per image on one core, so the workers are clearly faster."""
    from PIL import Image

    made = []
    for k in range(4):
        ramp = np.linspace(0, 255, 2400, dtype=np.float64)[None, :, None]
        pixels = np.broadcast_to(ramp, (1800, 2400, 3)).copy()
        pixels[..., k % 3] = 255 - pixels[..., k % 3]
        path = root / f"source{k}.jpg"
        Image.fromarray(pixels.astype(np.uint8)).save(path, quality=85)
        made.append(path)
    for split, count in (("train", TRAIN), ("val", 4)):
        for i in range(count):
            folder = root / "imgs" / split / ("a" if i % 2 else "b")
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(made[i % 4], folder / f"{i}.jpg")
    return root / "imgs"


@pytest.mark.extended  # CI runs it (make test-all); the trial's logic: tests/unit/test_decode_choice.py
def test_auto_times_each_way_keeps_the_faster_and_a_resume_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTIGPU_DECODE_CPU_STAND_IN", "1")
    data, out = _folder(tmp_path), tmp_path / "run"
    args = ("train", "--model", "linear", "--data", f"folder:{data}", "--image-size", "256",
            "--devices", "cpu:2", "--batch-size", "1", "--workers", "1", "--decode", "auto",
            "--out", out)
    proc = multigpu(*args, "--epochs", "1", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = re.findall(r"decode: samples/s over 6 windows of 10 steps in epoch 1: cpu ([\d,]+), "
                      r"gpu ([\d,]+), hybrid 50% ([\d,]+); (\S+) kept for the run", proc.stdout)
    assert len(said) == 1, proc.stdout[-3000:]  # rank 0 says it, once
    assert said[0][3] == "cpu", said
    chosen = json.loads((out / "decode.json").read_text())
    assert chosen["cpu_share"] == 1.0 and chosen["measured"] is True
    assert set(chosen["rates"]) == {"cpu", "gpu", "hybrid 50%"}
    assert read_metrics(out)[0]["train_samples"] == TRAIN  # every sample once, the trial's epoch too
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert state["decode"] == chosen

    again = multigpu(*args, "--epochs", "2", "--resume", out, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "decode:" not in again.stdout, again.stdout[-3000:]  # nothing measured again
    assert read_metrics(out)[1]["train_samples"] == TRAIN
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=True)["decode"] == chosen
