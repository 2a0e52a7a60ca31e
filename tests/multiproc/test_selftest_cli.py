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
def test_unwritable_checkpoint_folder_is_a_failed_check_with_its_cause(tmp_path):
    not_a_folder = tmp_path / "ckpt"
    not_a_folder.write_text("a file where the folder should be")
    logs = tmp_path / "logs"
    proc = multigpu("test", "--devices", "cpu:2", "--checkpoint-dir", not_a_folder, "--log-dir", logs)
    assert proc.returncode == 1
    rows = table(proc.stdout)
    assert rows["checkpoint"][0] == "FAIL"
    assert rows["checkpoint"][1].startswith(f"every rank: saving {not_a_folder}/selftest-")
    assert rows["checkpoint"][1].endswith(f"failed on rank 0: [Errno 17] File exists: '{not_a_folder}'")
    assert rows["DDP training"][0] == rows["autocast fp16"][0] == "ok"  # later checks still ran
    assert f"multigpu: self-test FAILED; every rank's log: {logs}" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not_a_folder.read_text() == "a file where the folder should be"
