"""`multigpu train`'s estimate against the time its epochs took, on a run long enough to tell."""
import math
import re

import pytest

from .conftest import multigpu

pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_a_30_second_cpu_run_takes_within_25_percent_of_its_estimate(tmp_path):
    epochs = 3
    took, late, told = _run(tmp_path / "run-3", epochs=epochs)
    while took < 30 and epochs < 60:  # a faster (or less loaded) machine: as many epochs as make 40 s
        epochs = min(60, math.ceil(epochs * 40 / took))
        took, late, told = _run(tmp_path / f"run-{epochs}", epochs=epochs)
    assert took >= 30, f"the run took {took:.0f} s: make it longer (more samples) to test the estimate"
    assert late <= 25, told


def _run(out, epochs: int) -> tuple[float, int, str]:
    """(seconds the epochs took, % off the estimate, the estimate and epoch lines)."""
    proc = multigpu("train", "--model", "mlp", "--data", "synthetic:20000", "--batch-size", "32",
                    "--workers", "0", "--epochs", str(epochs), "--devices", "cpu:1", "--out", out,
                    timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith("estimate: the ")]
    assert len(said) == 1, proc.stdout[-3000:]
    closing = re.fullmatch(rf"estimate: the {epochs} epochs took ([\d.]+) (s|min), estimated ~[\d.]+ "
                           r"(s|min) \((?:(\d+) % (?:longer|shorter) than estimated|as estimated|"
                           r"under 5 s: too short a run to compare)\)", said[0])
    assert closing, said[0]
    took = float(closing.group(1)) * (60 if closing.group(2) == "min" else 1)
    told = [line for line in proc.stdout.splitlines() if line.startswith(("estimate", "epoch"))]
    return took, int(closing.group(4) or 0), "\n".join(told)
