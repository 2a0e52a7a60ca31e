"""multigpu doctor's setup checks, the batch search and the probe's step, on the CPU."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from multigpu.train import batchfit
from multigpu.core.findings import Finding, report
from multigpu.doctor.probe import _train_step, _unused_finding
from multigpu.train.checks.setup_checks import (eval_coverage_finding, last_step_finding,
                                          launch_env_findings, refuse_stale_worker_env)
from multigpu.train.engine import StepSettings
from multigpu.core.errors import UsageError
from multigpu.core.runtime import setup


def test_stale_launch_variables_are_named_with_what_they_break_and_the_unset_line():
    [f] = launch_env_findings({"MASTER_PORT": "29500", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "HOME": "/"})
    assert f.level == "warn" and f.trap == 8
    assert "MASTER_PORT=29500, WORLD_SIZE=4, LOCAL_RANK=0" in f.message
    assert "wait for 4 processes that never come" in f.message
    assert "unset MASTER_PORT WORLD_SIZE LOCAL_RANK" in f.message


def test_inside_a_torchrun_worker_the_launch_variables_are_its_own():
    env = {"MASTER_PORT": "29500", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}
    assert [f.level for f in launch_env_findings(env)] == ["ok"]
    refuse_stale_worker_env(env)  # no error


def test_train_refuses_a_local_rank_left_in_the_shell():
    with pytest.raises(UsageError, match=r"LOCAL_RANK=0 set, but no launcher started this process.*unset LOCAL_RANK"):
        refuse_stale_worker_env({"LOCAL_RANK": "0"})
    refuse_stale_worker_env({"MASTER_PORT": "1"})  # harmless to train: its launcher sets its own


def test_the_posts_8607_samples_on_4_devices_keep_a_last_step_of_15():
    f = last_step_finding(8607, 4, ranks=4)
    assert f.level == "ok" and f.trap == 3
    assert "8607 training samples, 4 per device x 4 devices = 16 per step: 538 steps" in f.message
    assert "the last has 15 (4+4+4+3 per process)" in f.message


def test_a_remainder_too_small_for_every_device_joins_the_step_before():
    f = last_step_finding(995, 4, ranks=4)  # 62 full steps, 3 left: fewer than 2 per device
    assert "62 steps" in f.message
    assert ("a remainder of 3 (too few for 2 per device) joins the step before it, which has 19 "
            "(5+5+5+4 per process)") in f.message


def test_drop_last_and_an_exact_multiple_are_said_as_such():
    dropped = last_step_finding(8607, 4, ranks=4, drop_last=True)
    assert "the last 15 samples of each epoch's order are dropped" in dropped.message
    assert "all full" in last_step_finding(64, 8, ranks=2, devices_per_rank=2).message


def test_too_few_samples_for_one_step_fail():
    f = last_step_finding(3, 4, ranks=4)
    assert f.level == "fail" and "fewer than the 4 that one step needs" in f.message


@pytest.mark.parametrize("n,ranks", [(355, 2), (1, 1), (17, 3), (100, 4)])
def test_every_validation_sample_is_counted_once(n, ranks):
    f = eval_coverage_finding(n, 8, ranks=ranks)
    assert f.level == "ok" and f"each of the {n} validation samples counted once" in f.message


def test_the_report_prints_one_line_per_finding_and_fails_on_a_fail(capsys):
    code = report([Finding("ok", "a", "fine"), Finding("warn", "b", "hmm", trap=3, where="x.py:2"),
                   Finding("fail", "c", "broken")])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out[1] == "warn  b              x.py:2: hmm (trap 3)"
    assert out[-1] == "3 checks: 1 failed, 1 warnings"
    assert report([Finding("ok", "a", "fine")]) == 0


def _oom_above(limit, calls):
    def try_size(n):
        calls.append(n)
        if n > limit:
            raise torch.OutOfMemoryError("out of memory")
        return n * 1000
    return try_size


def test_the_batch_search_doubles_then_bisects_to_within_a_sixteenth():
    calls = []
    fit = batchfit.largest_batch(_oom_above(300, calls), start=32, limit=4096)
    assert calls[:5] == [32, 64, 128, 256, 512]
    assert fit.failed is not None and 300 - 300 // 16 <= fit.largest <= 300 < fit.failed
    assert fit.peak == fit.largest * 1000


def test_the_batch_search_stops_at_its_limit_and_at_a_budget():
    assert batchfit.largest_batch(_oom_above(10**9, []), start=3, limit=40) == batchfit.Fit(40, 40000, None)
    fit = batchfit.largest_batch(_oom_above(10**9, []), start=8, limit=4096, budget=100_000)
    assert fit.largest <= 100 < fit.failed


def test_the_batch_search_says_none_when_the_first_size_does_not_fit():
    assert batchfit.largest_batch(_oom_above(0, []), start=1, limit=8).largest is None


class _HalfUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.spare = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def test_the_probe_step_names_every_parameter_without_a_gradient():
    rt = setup("single", "fp32", accelerator="cpu")
    model = rt.prepare(_HalfUsed())
    job = SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=nn.functional.cross_entropy, settings=StepSettings())
    unused, _ = _train_step(rt, job, (torch.randn(8, 4), torch.randint(0, 2, (8,))))
    assert unused == ["spare.weight", "spare.bias"]
    fail = _unused_finding(unused, fails=True)
    assert fail.level == "fail" and "DDP stops at the second step" in fail.message
    assert "--find-unused-parameters" in fail.message and "requires_grad_(False)" in fail.message
    assert _unused_finding(unused, fails=False).level == "warn"


def test_bf16_on_a_gpu_without_bf16_units_fails_with_the_fix(monkeypatch):
    from multigpu.launcher.devices import DevicePlan
    from multigpu.train.checks.setup_checks import precision_findings

    plan = DevicePlan("cuda", (0, 1), 2, gpu_names=("Tesla V100-SXM2-32GB",) * 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (7, 0))  # Volta
    [f] = precision_findings("bf16", plan)
    assert f.level == "fail" and "no bf16 units" in f.message and "--precision fp16" in f.message
    assert (precision_findings("auto", plan)[0].message
            == "--precision auto is fp32 (no bf16 units) on Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))  # Hopper
    assert [f.level for f in precision_findings("bf16", plan)] == ["ok"]
    assert precision_findings("auto", plan, "resnet50")[0].message == "--precision auto is bf16 on Tesla V100-SXM2-32GB"
    [f] = precision_findings("auto", plan, "lstm")
    assert (f.level, f.message) == ("ok", "--precision auto is fp32 for lstm: its small steps are "
                                          "faster without bf16 autocast")


def test_a_whole_launch_set_without_torchrun_is_another_launchers_and_only_noted():
    said = []
    env = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    refuse_stale_worker_env(env, said.append)  # DeepSpeed's launcher, an MPI wrapper: no error
    assert len(said) == 1 and "taken as a worker of another launcher" in said[0] and "unset" in said[0]
