"""`multigpu test` through the real launcher on CPU: a passing machine, and a check that truly fails."""
import re

import pytest

from .conftest import multigpu

pytestmark = pytest.mark.slow

CHECKS = ["process group", "all_reduce", "broadcast", "all_gather", "barrier", "DDP training",
          "checkpoint", "autocast bf16", "autocast fp16"]


def table(stdout: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in stdout.splitlines():
        for name in CHECKS:
            if m := re.fullmatch(rf"{re.escape(name)}\s+(ok|FAIL|skip)\s+(.*)", line):
                rows[name] = m.groups()
    return rows


@pytest.mark.smoke
def test_selftest_passes_on_two_cpu_processes(tmp_path):
    proc = multigpu("test", "--devices", "cpu:2", "--log-dir", tmp_path / "logs")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = table(proc.stdout)
    assert list(rows) == CHECKS
    assert {status for status, _ in rows.values()} == {"ok"}
    assert rows["process group"][1] == "gloo, world size 2, ranks 0..1 on cpu (1 host)"
    assert rows["all_reduce"][1] == "sum of rank+1 = 3, max of rank = 1"
    assert re.fullmatch(r"ddp, 6 steps, loss [\d.]+ -> [\d.]+, weights equal on 2 ranks "
                        r"\(sha256 [0-9a-f]{12}\)", rows["DDP training"][1])
    assert rows["checkpoint"][1].startswith("rt.save/rt.load in a temporary folder: weights, "
                                            "optimizer and step back")
    assert "Traceback" not in proc.stderr


@pytest.mark.extended
def test_a_checkpoint_folder_that_is_a_file_is_one_line_before_any_check(tmp_path):
    """Every path option of every command (issue 40, item 2): refused before the launch, in one
    line, exit 2, the user's file untouched (the self-test ran and failed its checkpoint check
    before)."""
    not_a_folder = tmp_path / "ckpt"
    not_a_folder.write_text("a file where the folder should be")
    logs = tmp_path / "logs"
    proc = multigpu("test", "--devices", "cpu:2", "--checkpoint-dir", not_a_folder, "--log-dir", logs)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"multigpu: error: --checkpoint-dir {not_a_folder}: a file "
                                        "is there, not a folder; give another path"]
    assert not logs.exists() and "Traceback" not in proc.stdout + proc.stderr
    assert not_a_folder.read_text() == "a file where the folder should be"
