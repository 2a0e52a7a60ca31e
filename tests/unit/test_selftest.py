"""The self-test's report: merging every rank's outcomes into one row per check."""
from multigpu.doctor.selftest import format_table, merge


def test_merge_names_the_failing_rank_and_keeps_rank_0s_detail_otherwise():
    rank0 = [("all_reduce", "ok", "sum 3"), ("checkpoint", "ok", "back"), ("autocast bf16", "skip", "no bf16")]
    rank1 = [("all_reduce", "ok", "sum 3"), ("checkpoint", "FAIL", "disk full"), ("autocast bf16", "skip", "no bf16")]
    assert merge([rank0, rank1]) == [("all_reduce", "ok", "sum 3"),
                                     ("checkpoint", "FAIL", "rank 1: disk full"),
                                     ("autocast bf16", "skip", "no bf16")]


def test_merge_says_every_rank_when_all_fail_alike_and_plain_cause_for_one_process():
    fail = [("barrier", "FAIL", "timed out")]
    assert merge([fail, fail]) == [("barrier", "FAIL", "every rank: timed out")]
    assert merge([fail]) == [("barrier", "FAIL", "timed out")]


def test_merge_reports_a_rank_with_fewer_results_as_failed():
    assert merge([[("a", "ok", "x"), ("b", "ok", "y")], [("a", "ok", "x")]]) == [
        ("a", "ok", "x"), ("b", "FAIL", "rank 1: no result")]


def test_table_aligns_columns():
    assert format_table([("barrier", "ok", "2 ms"), ("DDP training", "FAIL", "differ")]) == (
        "check         result  detail\n"
        "barrier       ok      2 ms\n"
        "DDP training  FAIL    differ")


def test_a_cause_is_one_line_with_the_type_only_where_it_tells_something():
    from multigpu.core.errors import UsageError
    from multigpu.doctor.selftest import CheckFailed, cause

    assert cause(RuntimeError("saving x failed on rank 0: disk full\nmore")) == (
        "saving x failed on rank 0: disk full")
    assert cause(CheckFailed("weights differ")) == "weights differ"
    assert cause(UsageError("bad value")) == "bad value"
    assert cause(PermissionError(13, "Permission denied")) == "PermissionError: [Errno 13] Permission denied"
    assert cause(TimeoutError()) == "TimeoutError"


def test_auto_without_a_gpu_is_two_cpu_processes_and_says_why(monkeypatch):
    from multigpu.launcher import devices
    from multigpu.cli.selftest import choose_devices

    def no_driver():
        raise devices.NvmlUnavailable("NVML: NVML Shared Library Not Found")

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "query_gpus", no_driver)
    plan = choose_devices("auto", 2.0)
    assert (plan.accelerator, plan.nproc) == ("cpu", 2)
    assert plan.describe() == ("2 CPU processes (gloo); no GPU found (no NVIDIA driver: NVML: "
                               "NVML Shared Library Not Found)")
    assert choose_devices("cpu:1", 2.0).nproc == 1  # asked for: kept


def test_a_bad_devices_spec_is_a_usage_error_before_anything_starts(capsys):
    from multigpu.cli import main

    assert main(["test", "--devices", "cpu:0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("multigpu: error: --devices cpu:0") and err.count("\n") == 1
