"""The self-test's report: merging every rank's outcomes into one row per check."""
from multigpu.selftest import format_table, merge


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
