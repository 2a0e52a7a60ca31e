"""`multigpu train`'s estimate against the time its epochs took, on a run long enough to tell."""
import re

import pytest

from .conftest import multigpu

pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_a_30_second_cpu_run_takes_within_25_percent_of_its_estimate(tmp_path):
    proc = multigpu("train", "--model", "mlp", "--data", "synthetic:20000", "--batch-size", "32",
                    "--workers", "0", "--epochs", "3", "--devices", "cpu:1", "--out", tmp_path / "run",
                    timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith("estimate: the ")]
    assert len(said) == 1, proc.stdout[-3000:]
    closing = re.fullmatch(r"estimate: the 3 epochs took ([\d.]+) (s|min), estimated ~[\d.]+ (s|min) "
                           r"\((\d+) % (longer|shorter) than estimated\)", said[0])
    assert closing, said[0]
    took = float(closing.group(1)) * (60 if closing.group(2) == "min" else 1)
    assert took >= 30, f"the run took {took:.0f} s: make it longer (more samples) to test the estimate"
    told = [line for line in proc.stdout.splitlines() if line.startswith(("estimate", "epoch"))]
    assert int(closing.group(4)) <= 25, "\n".join(told)
