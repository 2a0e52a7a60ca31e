"""multigpu bench without launching anything: the maths, the plan of launches, the report files."""
import dataclasses
import json
import statistics

import pytest

from multigpu.bench import report, runner, spec, stats
from multigpu.bench.spec import BenchSettings, Task
from multigpu.launcher.devices import DevicePlan
from multigpu.core.errors import UsageError
from multigpu.train.settings.flagwords import say

SYNTHETIC = {"synthetic": ("synthetic", 1000)}  # data kind -> (Task.data, num_outputs)
REAL = {"real": ("folder:/x", 10)}


# --------------------------------------------------------------------------- statistics

def test_trial_stats_median_and_spread_of_throughput_and_step_time():
    s = stats.trial_stats([2.0, 1.0, 4.0], [1000, 1000, 1000], steps=10)
    assert s["img_per_s"] == 500 and (s["img_per_s_min"], s["img_per_s_max"]) == (250, 1000)
    assert s["step_ms"] == 200 and (s["step_ms_min"], s["step_ms_max"]) == (100, 400)
    assert s["spread_pct"] == pytest.approx(150.0)
    even = stats.trial_stats([1.0, 2.0], [100, 100], steps=1)
    assert even["img_per_s"] == statistics.median([100, 50])


def test_trial_stats_needs_one_sample_count_per_trial():
    with pytest.raises(ValueError):
        stats.trial_stats([1.0, 2.0], [10], steps=1)


def test_scaling_efficiency_against_the_single_gpu_run():
    assert stats.scaling_efficiency(12_000, 4, 4_000) == pytest.approx(0.75)
    assert stats.scaling_efficiency(4_000, 1, 4_000) == 1.0
    assert stats.scaling_efficiency(12_000, 4, None) is None


@pytest.mark.parametrize("name,precision,peak", [
    ("NVIDIA H200", "bf16", 989e12), ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "fp16", 312e12), ("NVIDIA H100 PCIe", "bf16", None),
    ("NVIDIA H200", "fp32", None), ("Tesla T4", "bf16", None), (None, "bf16", None),
])
def test_peak_flops_table(name, precision, peak):
    assert stats.peak_flops(name, precision) == peak


def test_mfu_is_flops_per_second_over_peak():
    # BASELINE's 1-GPU ResNet-50 step: 3.11 TFLOP in 29.8 ms on an H200 -> about 10.6 %.
    assert stats.mfu(3.11e12, 0.0298, 989e12) == pytest.approx(3.11e12 / 0.0298 / 989e12)
    assert stats.mfu(None, 0.03, 989e12) is None and stats.mfu(1e12, 0.03, None) is None


def test_flops_of_an_mlp_step_are_counted_exactly():
    b, i = 4, 3 * 8 * 8
    layers = [(i, 256), (256, 256), (256, 1000)]
    forward = sum(2 * b * m * n for m, n in layers)
    # backward: weight gradients of every layer, input gradients of all but the first
    backward = forward + sum(2 * b * m * n for m, n in layers[1:])
    assert stats.train_step_flops("mlp", (3, 8, 8), 1000, b) == forward + backward


# --------------------------------------------------------------------------- flags and plan

def test_parse_lists_and_methods():
    assert spec.parse_int_list("1, 2,4,2", "--gpus") == (1, 2, 4)
    with pytest.raises(UsageError, match="--gpus '0,2'"):
        spec.parse_int_list("0,2", "--gpus")
    with pytest.raises(UsageError, match="unknown method 'deepspeed'.*choose from"):
        spec.parse_methods("ddp,deepspeed")
    with pytest.raises(UsageError, match="unknown model"):
        spec.parse_models("resnet51")
    with pytest.raises(UsageError, match="--model lstm: bench times models on image batches, and lstm takes "
                                         "timeseries windows; time it with `multigpu train --model lstm"):
        spec.parse_models("resnet18,lstm")


def test_ddp_variants_are_methods_and_an_unknown_variant_lists_the_known_ones():
    methods = "multigpu-single,multigpu-ddp,multigpu-ddp:static,multigpu-ddp:bucket25,ddp"
    assert spec.parse_methods(methods) == tuple(methods.split(","))
    assert set(spec.DDP_VARIANTS) == {"bucket25", "bucket200", "static", "bcast", "bf16hook",
                                      "ctas8", "bucket25-ctas8"}
    with pytest.raises(UsageError, match="unknown DDP variant 'multigpu-ddp:fast'; choose from "
                                         "multigpu-ddp:bucket25,multigpu-ddp:bucket200,"
                                         "multigpu-ddp:static,multigpu-ddp:bcast,"
                                         "multigpu-ddp:bf16hook,multigpu-ddp:ctas8,"
                                         "multigpu-ddp:bucket25-ctas8$"):
        spec.parse_methods("multigpu-ddp,multigpu-ddp:fast")
    with pytest.raises(UsageError, match="unknown DDP variant 'multigpu-ddp:'"):
        spec.parse_methods("multigpu-ddp:")
    with pytest.raises(UsageError, match="unknown method 'ddp:static'.*or multigpu-ddp:VARIANT"):
        spec.parse_methods("ddp:static")
    assert (spec.ddp_variant("multigpu-ddp:static"), spec.ddp_variant("multigpu-ddp"),
            spec.ddp_variant("ddp")) == ("static", None, None)


def test_gpu_counts_default_and_too_many():
    assert spec.gpu_counts(None, 4, "GPUs", "") == (1, 2, 4)
    assert spec.gpu_counts(None, 6, "GPUs", "") == (1, 2, 4, 6)
    with pytest.raises(UsageError, match=r"--gpus 1,2,8: 8 is more than the 4 GPUs .*use --gpus 1,2"):
        spec.gpu_counts((1, 2, 8), 4, "GPUs", "--devices auto")


def test_more_gpus_than_cpu_processes_is_a_usage_error_before_any_launch(tmp_path):
    with pytest.raises(UsageError, match="more than the 2 CPU processes"):
        runner.run(BenchSettings(models=("mlp",), gpus=(1, 4), devices="cpu:2",
                                 out=str(tmp_path / "x.json")))


def test_a_method_of_several_devices_on_one_is_named_with_why_and_nothing_planned_is_refused(tmp_path):
    s = BenchSettings(models=("mlp",), methods=("multigpu-ddp",), gpus=(1,))
    groups, skipped = spec.plan_groups(s, "cuda", (1,), SYNTHETIC)
    assert groups == []
    assert skipped == [{"method": "multigpu-ddp", "reason": (
        "multigpu-ddp runs on 2 or more GPUs, and --gpus 1 asks for none: add a count of 2 or more "
        "to --gpus, or use multigpu-single for one")}]
    with pytest.raises(UsageError) as refused:
        runner.run(BenchSettings(models=("mlp",), methods=("multigpu-ddp",), gpus=(1,),
                                 devices="cpu:2", out=str(tmp_path / "x.json")))
    assert str(refused.value) == (
        "nothing to measure: multigpu-ddp: multigpu-ddp runs on 2 or more CPU processes, and "
        "--gpus 1 asks for none: add a count of 2 or more to --gpus, or use multigpu-single for one")
    assert not (tmp_path / "x.json").exists()


def test_plan_on_gpus_groups_tasks_into_few_launches_in_order_of_importance(monkeypatch):
    monkeypatch.setattr(spec, "unavailable_reason", lambda *a: None)  # every peer installed
    s = BenchSettings(gpus=(1, 2, 4), steps=30, warmup=10, dp_steps=2)
    groups, skipped = spec.plan_groups(s, "cuda", (1, 2, 4), SYNTHETIC)
    assert skipped == []
    assert [(g.nproc, g.visible) for g in groups] == [(1, 1), (4, 4), (2, 2), (1, 4)]
    assert [t.method for t in groups[0].tasks] == ["multigpu-single", "ddp", "accelerate", "fabric"]
    assert [t.method for t in groups[1].tasks] == ["multigpu-ddp", "ddp", "accelerate", "fabric"]
    assert {t.gpus for t in groups[1].tasks} == {4}
    dp = groups[3].tasks
    assert [(t.method, t.gpus, t.steps, t.warmup) for t in dp] == [("multigpu-dp", 2, 2, 2),
                                                                   ("multigpu-dp", 4, 2, 2)]
    keys = [t.key for g in groups for t in g.tasks]
    assert len(keys) == len(set(keys)) == 14


def test_plan_on_cpu_skips_dataparallel_and_library_peers_with_a_reason():
    s = BenchSettings(models=("mlp",), batch_sizes=(8, 16))
    groups, skipped = spec.plan_groups(s, "cpu", (1, 2), SYNTHETIC)
    assert {x["method"] for x in skipped} == {"multigpu-dp", "accelerate", "fabric"}
    assert all(x["reason"] for x in skipped)
    assert [(g.nproc, g.visible) for g in groups] == [(1, 0), (2, 0)]
    assert [(t.method, t.batch_size) for t in groups[1].tasks] == [
        ("multigpu-ddp", 8), ("ddp", 8), ("multigpu-ddp", 16), ("ddp", 16)]


def test_ddp_variants_run_in_the_n_process_groups_and_take_turns_with_multigpu_ddp():
    from multigpu.bench import worker

    methods = ("multigpu-single", "multigpu-ddp", "multigpu-ddp:static", "multigpu-ddp:bucket25",
               "ddp", "multigpu-ddp:bf16hook")
    s = BenchSettings(models=("mlp",), methods=methods, compile="default")
    groups, skipped = spec.plan_groups(s, "cuda", (1, 2, 4), SYNTHETIC)
    assert [t.method for t in groups[0].tasks] == ["multigpu-single", "ddp"]
    for group, n in zip(groups[1:], (4, 2)):
        assert [(t.method, t.gpus) for t in group.tasks] == [(m, n) for m in methods[1:]]
        (one_set,) = worker.interleave_sets(group.tasks)
        assert len(one_set) == 5, "all variants take turns with multigpu-ddp and the peer"
    assert [(t.method, t.compile) for t in groups[1].tasks if t.method != "ddp"] == [
        (m, "default") for m in methods[1:] if m != "ddp"], "--compile applies to the variants too"
    assert groups[1].describe().endswith(": " + ", ".join(methods[1:]))
    assert not skipped
    _, on_cpu = spec.plan_groups(s, "cpu", (1, 2), SYNTHETIC)
    assert [x for x in on_cpu if x["method"].startswith("multigpu-ddp")] == [
        {"method": "multigpu-ddp:bf16hook", "reason": "torch's bf16_compress_hook needs NCCL on "
                                                      "GPUs (gloo refuses it)"}]


def test_fsdp_is_asked_for_by_name_and_runs_in_the_n_process_groups_with_ddp():
    assert "multigpu-fsdp" in spec.METHODS and "multigpu-fsdp" not in BenchSettings().methods
    s = BenchSettings(models=("mlp",), methods=("multigpu-single", "multigpu-ddp", "multigpu-fsdp"))
    groups, skipped = spec.plan_groups(s, "cpu", (1, 2), SYNTHETIC)
    assert [[t.method for t in g.tasks] for g in groups] == [
        ["multigpu-single"], ["multigpu-ddp", "multigpu-fsdp"]]
    assert not skipped
    with pytest.raises(UsageError, match="which multigpu-fsdp cannot replay .*: leave "
                                         "multigpu-fsdp out of --methods"):
        spec.validate(BenchSettings(models=("mlp",), compile="reduce-overhead",
                                    methods=("multigpu-ddp", "multigpu-fsdp")))


def test_nccl_only_variants_are_skipped_on_cpu_with_the_reason():
    s = BenchSettings(models=("mlp",), methods=("multigpu-ddp", "multigpu-ddp:ctas8",
                                                "multigpu-ddp:bucket25-ctas8"))
    groups, skipped = spec.plan_groups(s, "cpu", (2,), SYNTHETIC)
    assert [t.method for g in groups for t in g.tasks] == ["multigpu-ddp"]
    assert skipped == [{"method": m, "reason": "NCCL's maxCTAs is a setting of NCCL "
                                               "communicators; gloo has none"}
                       for m in ("multigpu-ddp:ctas8", "multigpu-ddp:bucket25-ctas8")]
    on_gpus, none_skipped = spec.plan_groups(s, "cuda", (2,), SYNTHETIC)
    assert len(on_gpus[0].tasks) == 3 and not none_skipped


def test_nccl_max_ctas_without_nccl_is_a_usage_error():
    from multigpu.core.distributed import nccl_group_with_max_ctas

    with pytest.raises(UsageError, match=r"nccl_max_ctas=8 needs the NCCL backend .* leave it "
                                         r"unset on CPU"):
        nccl_group_with_max_ctas(8)


def test_real_data_tasks_never_take_turns_not_even_ddp_variants():
    from multigpu.bench import worker

    s = BenchSettings(models=("mlp",), data=("synthetic", "real"),
                      methods=("multigpu-ddp", "multigpu-ddp:bcast"))
    groups, _ = spec.plan_groups(s, "cpu", (2,), REAL | SYNTHETIC)
    assert [[(t.method, t.data_kind) for t in one] for one in worker.interleave_sets(
        groups[0].tasks)] == [[("multigpu-ddp", "synthetic"), ("multigpu-ddp:bcast", "synthetic")],
                              [("multigpu-ddp", "real")], [("multigpu-ddp:bcast", "real")]]


def test_each_real_kind_is_timed_alone():
    from multigpu.bench import worker

    s = BenchSettings(models=("mlp",), data=("real", "real-cpu"), methods=("multigpu-ddp",))
    inputs = {"real": REAL["real"], "real-cpu": REAL["real"]}
    groups, _ = spec.plan_groups(s, "cpu", (2,), inputs)
    assert [[t.data_kind for t in one] for one in worker.interleave_sets(groups[0].tasks)] == [
        ["real"], ["real-cpu"]]


def test_real_data_skips_the_peers():
    s = BenchSettings(models=("mlp",), data=("real",), methods=("multigpu-ddp", "ddp"))
    groups, skipped = spec.plan_groups(s, "cpu", (2,), REAL)
    assert [t.method for g in groups for t in g.tasks] == ["multigpu-ddp"]
    assert skipped[0]["method"] == "ddp" and "--data real" in skipped[0]["reason"]


def test_both_data_kinds_share_the_launches_synthetic_first_and_peers_on_synthetic_only():
    s = BenchSettings(models=("mlp",), data=("synthetic", "real"),
                      methods=("multigpu-single", "multigpu-ddp", "ddp", "accelerate"))
    groups, skipped = spec.plan_groups(s, "cpu", (1, 2), REAL | SYNTHETIC)  # order of kinds: fixed
    assert [(g.nproc, g.visible) for g in groups] == [(1, 0), (2, 0)]
    assert [(t.method, t.data, t.num_outputs) for t in groups[0].tasks] == [
        ("multigpu-single", "synthetic", 1000), ("ddp", "synthetic", 1000),
        ("multigpu-single", "folder:/x", 10)]
    assert [(t.method, t.data_kind) for t in groups[1].tasks] == [
        ("multigpu-ddp", "synthetic"), ("ddp", "synthetic"), ("multigpu-ddp", "real")]
    keys = [t.key for g in groups for t in g.tasks]
    assert len(keys) == len(set(keys)) == 6
    # ddp is skipped for the real tasks only; accelerate, skipped for both kinds, is named once
    assert [x["method"] for x in skipped] == ["accelerate", "ddp"]
    assert "--data real" in skipped[1]["reason"] and "GPUs only" in skipped[0]["reason"]


def test_compile_lands_in_the_multigpu_tasks_and_rows_only():
    s = BenchSettings(models=("mlp",), methods=("multigpu-single", "multigpu-ddp", "ddp"),
                      compile="reduce-overhead")
    groups, _ = spec.plan_groups(s, "cpu", (1, 2), SYNTHETIC)
    assert [(t.method, t.compile) for g in groups for t in g.tasks] == [
        ("multigpu-single", "reduce-overhead"), ("ddp", None), ("multigpu-ddp", "reduce-overhead"),
        ("ddp", None)]
    single, peer = groups[0].tasks
    rows = [report.build_row(t, _ranks(t, [[0.1] * 3]), None) for t in (single, peer)]
    assert [r["compile"] for r in rows] == ["reduce-overhead", None]
    assert [report.compile_label(m) for m in ("reduce-overhead", "default", True, None, False)] == [
        " +compile:reduce-overhead", " +compile", " +compile", "", ""]  # True/False: older JSON
    no_compile, _ = spec.plan_groups(BenchSettings(models=("mlp",)), "cpu", (1,), SYNTHETIC)
    assert not any(t.compile for t in no_compile[0].tasks)


def test_cuda_graph_modes_are_refused_with_dataparallel_and_on_cpu():
    graphs = dict(models=("mlp",), compile="reduce-overhead")
    with pytest.raises(UsageError, match="leave multigpu-dp out of --methods"):
        spec.validate(BenchSettings(**graphs))  # the default methods include multigpu-dp
    with pytest.raises(UsageError) as caught:
        spec.validate(BenchSettings(**graphs, methods=("multigpu-ddp",), devices="cpu:2"))
    assert say(caught.value).endswith("need GPUs; on cpu use --compile default")  # as bench says it
    spec.validate(BenchSettings(**graphs, methods=("multigpu-ddp",)))
    spec.validate(BenchSettings(models=("mlp",), compile="default", devices="cpu:2"))


def test_the_worker_compiles_the_prepared_model_as_train_does(monkeypatch):
    import torch

    from multigpu.bench import worker

    compiled = []

    class Compiled(torch.nn.Module):  # stands in for torch.compile's OptimizedModule
        def __init__(self, model, mode=None):
            super().__init__()
            self._orig_mod, self.mode = model, mode
            compiled.append(self)

        def forward(self, *args, **kwargs):
            return self._orig_mod(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", Compiled)
    task = Task("multigpu-single", "mlp", 4, 1, 8, "fp32", "synthetic", 1000, 1, 1, 1,
                compile="default")
    assert worker._config(task, "single").compile  # the real-data path: training.build_job compiles
    prep = worker.build_multigpu(task, "cpu", "single")
    assert prep.step() == 4 and len(compiled) == 1
    assert compiled[0].mode is None  # "default" is torch.compile's default mode
    graphs = dataclasses.replace(task, compile="reduce-overhead")
    with pytest.raises(UsageError) as caught:
        worker.build_multigpu(graphs, "cpu", "single")
    assert say(caught.value).endswith("need GPUs; on cpu use --compile default")
    assert prep.info["wrapper"] == type(compiled[0]._orig_mod).__name__ != "Compiled"
    plain = dataclasses.replace(task, compile=None)
    assert not worker._config(plain, "single").compile
    worker.build_multigpu(plain, "cpu", "single").step()
    assert len(compiled) == 1


@pytest.mark.parametrize("method,options", [
    ("multigpu-ddp", {}), ("multigpu-ddp:bucket25", {"bucket_cap_mb": 25}),
    ("multigpu-ddp:bucket200", {"bucket_cap_mb": 200}), ("multigpu-ddp:static", {"static_graph": True}),
    ("multigpu-ddp:bcast", {"broadcast_buffers": True}), ("multigpu-ddp:bf16hook", {}),
    ("multigpu-ddp:ctas8", {"nccl_max_ctas": 8}),
    ("multigpu-ddp:bucket25-ctas8", {"bucket_cap_mb": 25, "nccl_max_ctas": 8}),
])
def test_the_worker_builds_a_ddp_variant_with_its_ddp_options(monkeypatch, method, options):
    import multigpu.core.runtime
    from multigpu.bench import worker
    from multigpu.core.strategies import DDPOptions

    runtimes, setup = [], multigpu.core.runtime.setup

    def recording_setup(*args, **kwargs):
        runtimes.append(setup(*args, **kwargs))
        return runtimes[-1]

    monkeypatch.setattr(multigpu.core.runtime, "setup", recording_setup)
    task = Task(method, "mlp", 4, 1, 8, "fp32", "synthetic", 1000, 1, 1, 1)
    prep = worker.build(task, "cpu")  # one process: DDP has nothing to wrap, the options still hold
    assert prep.step() == 4
    (rt,) = runtimes
    train = DDPOptions(broadcast_buffers=False)  # multigpu train's settings (training.ddp_options)
    assert rt.strategy.name == "ddp" and rt.strategy.options == dataclasses.replace(train, **options)
    assert DDPOptions().bucket_cap_mb == 100, "bucket25 differs from our default"


def test_the_bf16hook_variant_registers_the_hook_on_the_ddp_wrapper_only():
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from multigpu.bench import worker

    class Wrapper(DistributedDataParallel):  # a DDP wrapper without a process group
        def __init__(self):
            torch.nn.Module.__init__(self)

        def register_comm_hook(self, state, hook):
            hooks.append((state, hook))

    hooks = []
    worker.add_comm_hook(_task("multigpu-ddp:bf16hook", 2), Wrapper())
    assert hooks == [(None, default_hooks.bf16_compress_hook)]
    worker.add_comm_hook(_task("multigpu-ddp:bf16hook", 1), torch.nn.Linear(2, 2))  # one process
    for method in ("multigpu-ddp", "multigpu-ddp:static", "ddp"):
        worker.add_comm_hook(_task(method, 2), Wrapper())
    assert len(hooks) == 1


def test_consecutive_tasks_that_differ_only_in_the_method_form_one_set():
    from multigpu.bench import worker

    methods = ("multigpu-single", "ddp", "accelerate", "fabric")
    tasks = [_task(m, 1, batch=b) for b in (64, 128) for m in methods]
    assert [[(t.method, t.batch_size) for t in one] for one in worker.interleave_sets(tasks)] == [
        [(m, 64) for m in methods], [(m, 128) for m in methods]]
    other = [_task("multigpu-ddp", 2), _task("ddp", 2), _task("ddp", 4), _task("multigpu-ddp", 4),
             _task("multigpu-ddp", 4, data="folder:/x"), _task("multigpu-ddp", 4, compile=True),
             _task("ddp", 4)]
    assert [len(s) for s in worker.interleave_sets(other)] == [2, 2, 1, 2]  # compiled vs eager peer
    settings = BenchSettings(models=("mlp",), methods=("multigpu-single", "multigpu-ddp", "ddp"),
                             batch_sizes=(8, 16), data=("synthetic", "real"))
    groups, _ = spec.plan_groups(settings, "cpu", (1, 2), REAL | SYNTHETIC)
    assert [[(t.method, t.batch_size, t.data_kind) for t in one]
            for one in worker.interleave_sets(groups[1].tasks)] == [
        [("multigpu-ddp", 8, "synthetic"), ("ddp", 8, "synthetic")],
        [("multigpu-ddp", 16, "synthetic"), ("ddp", 16, "synthetic")],
        [("multigpu-ddp", 8, "real")], [("multigpu-ddp", 16, "real")]]


def _fake_build(log, closed):
    """build() for worker.run_set: each step appends the method's name to `log`."""
    import torch

    from multigpu.bench.measure import Prepared

    def build(task, accelerator):
        log.append(("build", task.method))

        def step():
            log.append(task.method)
            return task.batch_size

        return Prepared(step, [torch.device("cpu")], {"wrapper": task.method},
                        close=lambda: closed.append(task.method))
    return build


def test_a_set_is_built_and_warmed_up_in_order_then_its_trials_take_turns():
    from multigpu.bench import worker

    a, b = (Task(m, "mlp", 4, 1, 8, "fp32", "synthetic", 1000, 1, 2, 3) for m in ("A", "B"))
    log, closed, begins = [], [], []
    records = worker.run_set([a, b], "cpu", begins.append, _fake_build(log, closed))
    builds = [("build", "A"), "A", ("build", "B"), "B"]  # warm-up: 1 step each
    assert log == builds + ["A", "A", "B", "B"] * 3  # 3 trials of 2 steps, in turns
    assert [(r["key"], len(r["seconds"]), r["samples"], r["interleaved"], r["wrapper"])
            for r in records] == [(a.key, 3, [8] * 3, 2, "A"), (b.key, 3, [8] * 3, 2, "B")]
    assert [(x["phase"], x["key"]) for x in begins] == [("build", a.key), ("build", b.key),
                                                        ("trials", a.key)]
    assert begins[-1]["keys"] == [a.key, b.key] and closed == ["A", "B"]
    log.clear()
    (alone,) = worker.run_set([a], "cpu", begins.append, _fake_build(log, closed))
    assert log == [("build", "A")] + ["A"] * 7 and alone["interleaved"] == 1
    assert begins[-1] == {"kind": "begin", "phase": "build", "key": a.key}


def test_interleaved_memory_peak_is_the_whole_device_and_others_memory_is_recorded(monkeypatch):
    """A fake device: each method holds `resident` bytes once built, and a step needs `transient`
    more; the peak of each task is read over its own steps only."""
    from multigpu.bench import measure, worker

    mem = {"now": 0, "peak": 0}
    sizes = {"A": (10, 5), "B": (20, 1)}  # method -> (resident, transient)
    monkeypatch.setattr(measure, "allocated", lambda devices: [mem["now"]])
    monkeypatch.setattr(measure, "peak_allocated", lambda devices: [mem["peak"]])
    monkeypatch.setattr(measure, "reset_peak", lambda devices: mem.update(peak=mem["now"]))
    monkeypatch.setattr(measure, "release_memory", lambda devices: mem.update(peak=mem["now"]))

    def build(task, accelerator):
        resident, transient = sizes[task.method]
        mem["now"] += resident
        mem["peak"] = max(mem["peak"], mem["now"])

        def step():
            mem["peak"] = max(mem["peak"], mem["now"] + transient)
            return 1
        return measure.Prepared(step, [])

    a, b = (Task(m, "mlp", 4, 1, 8, "fp32", "synthetic", 1000, 1, 2, 2) for m in ("A", "B"))
    ra, rb = worker.run_set([a, b], "cpu", lambda rec: None, build)
    def memory(r):
        return r["memory_before"], r["peak_memory"], r["memory_held_by_others"]

    assert memory(ra) == ([0], [35], [20]) and memory(rb) == ([10], [31], [10])
    # its own peak is peak - held_by_others: 15 = 10 + 5 for A, 21 = 20 + 1 for B


def test_group_plan_shows_the_first_gpus_of_the_device_plan():
    base = DevicePlan("cuda", (0, 1, 2, 3), 4, ("H200",) * 4, ("4", "5", "6", "7"))
    sub = runner.group_plan(base, spec.Group(1, 2))
    assert (sub.gpu_ids, sub.nproc, sub.cuda_visible_devices()) == ((0, 1), 1, "4,5")
    assert runner.group_plan(DevicePlan("cpu", (), 2), spec.Group(2, 0)).nproc == 2


def test_out_path_is_dated_and_never_overwritten(tmp_path):
    first = runner.resolve_out(str(tmp_path), "4xH200")
    assert first.parent == tmp_path and first.name.endswith("-4xH200.json")
    first.write_text("{}")
    assert runner.resolve_out(str(tmp_path), "4xH200").name.endswith("-4xH200-2.json")
    with pytest.raises(UsageError, match="never overwritten"):
        runner.resolve_out(str(first), "4xH200")


# --------------------------------------------------------------------------- report

def _task(method, gpus, batch=32, data="synthetic", compile=False):
    return Task(method, "resnet50", batch, gpus, 224, "bf16", data, 1000 if data == "synthetic" else 10,
                2, 10, 3, compile)


def _ranks(task, seconds_per_rank):
    return [{"kind": "task", "key": task.key, "rank": r, "seconds": secs,
             "samples": [task.batch_size * task.gpus * task.steps] * task.trials,
             "memory_before": [0], "peak_memory": [(r + 1) * 2**30], "device_names": ["NVIDIA H200"],
             "setup_seconds": 1.0, "warmup": task.warmup, "precision": "bf16", "strategy": "ddp",
             "wrapper": "DistributedDataParallel", "optimizer": "SGD"}
            for r, secs in enumerate(seconds_per_rank)]


def _report(tmp_path):
    single, ddp = _task("multigpu-single", 1), _task("multigpu-ddp", 2)
    rows = [report.build_row(single, _ranks(single, [[0.1, 0.1, 0.1]]), 3.0e12),
            report.build_row(ddp, _ranks(ddp, [[0.1, 0.2, 0.1], [0.125, 0.1, 0.125]]), 3.0e12)]
    report.add_scaling(rows)
    s = BenchSettings(gpus=(1, 2), command="multigpu bench --gpus 1,2")
    rep = runner.new_report(s, DevicePlan("cuda", (0, 1), 2, ("NVIDIA H200",) * 2), (1, 2), "2xH200")
    rep["rows"] = rows
    return rep


def test_rows_take_the_slowest_rank_per_trial_and_scale_against_single(tmp_path):
    rows = _report(tmp_path)["rows"]
    ddp = rows[1]
    assert ddp["trial_seconds"] == [0.125, 0.2, 0.125]
    assert ddp["global_batch"] == 64
    assert ddp["img_per_s"] == pytest.approx(64 * 10 / 0.125)
    assert ddp["scaling_efficiency"] == pytest.approx((640 / 0.125) / (2 * 320 / 0.1))
    assert ddp["peak_memory_gib"] == [1.0, 2.0]
    assert ddp["mfu"] == pytest.approx(3.0e12 / 0.0125 / 989e12)
    assert rows[0]["scaling_efficiency"] == 1.0


def test_json_holds_machine_versions_settings_and_every_row(tmp_path):
    rep = _report(tmp_path)
    path = tmp_path / "r.json"
    report.write_json(rep, path)
    data = json.loads(path.read_text())
    assert data["schema"] == report.SCHEMA and data["command"].startswith("multigpu bench")
    assert {"label", "hostname", "gpu_name", "gpu_count"} <= set(data["machine"])
    assert {"multigpu", "torch", "python", "accelerate", "lightning"} <= set(data["versions"])
    assert data["settings"]["gpus"] == [1, 2] and data["settings"]["backend_flags"]["cudnn.benchmark"]
    assert [set(r) for r in data["rows"]] == [set(report.ROW_KEYS)] * 2
    assert not list(tmp_path.glob(".*.tmp"))


def test_plot_writes_a_png_and_the_table_prints(tmp_path, capsys):
    rep = _report(tmp_path)
    path = report.plot(rep, tmp_path / "r.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report.print_table(rep)
    out = capsys.readouterr().out
    assert "multigpu-ddp" in out and "2xH200" in out
    assert "steady state" not in out  # synthetic rows only


def test_a_batch_sweep_at_one_gpu_count_is_plotted_against_the_batch(tmp_path):
    def row(method, gpus, batch):
        t = _task(method, gpus, batch=batch)
        return report.build_row(t, _ranks(t, [[0.1] * 3] * gpus), None)

    sweep = [row(m, g, b) for b in (32, 64) for m, g in (("multigpu-single", 1), ("ddp", 4))]
    sweep += [row("ddp", 1, b) for b in (64, 32)]  # a peer also measured on one GPU (--gpus 1,4)
    assert report.is_batch_sweep(sweep)
    assert not report.is_batch_sweep(sweep + [row("ddp", 2, 32)]), "two GPU counts: by GPUs"
    assert not report.is_batch_sweep([r for r in sweep if r["batch_size"] == 32]), "one batch"
    rep = _report(tmp_path)
    rep["rows"] = sweep
    report.add_scaling(sweep)
    assert report.plot(rep, tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_of_synthetic_is_real_over_the_synthetic_row_of_the_same_method_and_gpus():
    def row(method, gpus, data, seconds):
        t = _task(method, gpus, data=data)
        return report.build_row(t, _ranks(t, [[seconds] * 3] * gpus), None)

    rows = [row("multigpu-ddp", 2, "synthetic", 0.1), row("multigpu-ddp", 4, "synthetic", 0.05),
            row("multigpu-ddp", 2, "folder:/x", 0.125), row("multigpu-single", 1, "folder:/x", 0.1)]
    report.add_of_synthetic(rows)
    assert [r["data"] for r in rows] == ["synthetic", "synthetic", "real", "real"]
    assert rows[2]["of_synthetic"] == pytest.approx(0.8)
    assert rows[0]["of_synthetic"] is rows[1]["of_synthetic"] is None
    assert rows[3]["of_synthetic"] is None, "no synthetic multigpu-single row to compare with"


def test_table_and_plot_keep_the_data_kinds_apart_and_mark_compiled_rows(tmp_path, capsys):
    rep = _report(tmp_path)
    real = _task("multigpu-ddp", 2, data="folder:/x", compile=True)
    rep["rows"].append(report.build_row(real, _ranks(real, [[0.25] * 3] * 2), None))
    report.add_scaling(rep["rows"])
    report.add_of_synthetic(rep["rows"])
    assert rep["rows"][2]["of_synthetic"] == pytest.approx(0.5)
    settings = runner.new_report(BenchSettings(data=("synthetic", "real")),
                                 DevicePlan("cpu", (), 2), (1, 2), "2xCPU")["settings"]
    assert json.loads(json.dumps(settings))["data"] == ["synthetic", "real"]
    rep["settings"]["data"] = settings["data"]
    report.print_table(rep)
    out = capsys.readouterr().out
    assert "synthetic and real data" in out and "of synth." in out and " 50%" in out
    assert "multigpu-ddp +compile" in out and "│ real" in out
    assert report.STEADY_STATE_NOTE in " ".join(out.split())  # rich wraps it
    assert set(report._series(rep["rows"])) == {"multigpu-single", "multigpu-ddp",
                                                 "multigpu-ddp real"}
    assert report.plot(rep, tmp_path / "r.png").exists()


def test_a_ddp_variant_row_names_its_variant_and_its_line_starts_from_the_single_gpu_point(
        tmp_path):
    rep = _report(tmp_path)
    static = _task("multigpu-ddp:static", 2)
    rep["rows"].append(report.build_row(static, _ranks(static, [[0.1] * 3] * 2), None))
    report.add_scaling(rep["rows"])
    assert [r["variant"] for r in rep["rows"]] == [None, None, "static"]
    assert rep["rows"][2]["scaling_efficiency"] == pytest.approx(1.0)
    series = report._series(rep["rows"])
    single = rep["rows"][0]["img_per_s"]
    assert [p[0] for p in series["multigpu-ddp:static"]] == [1, 2]
    assert series["multigpu-ddp:static"][0] == (1, single, 1.0) == series["multigpu-ddp"][0]
    assert report.plot(rep, tmp_path / "r.png").exists()


def test_machine_label():
    assert report.machine_label("cuda", 4, "NVIDIA H200") == "4xH200"
    assert report.machine_label("cuda", 8, "NVIDIA A100-SXM4-80GB") == "8xA100"
    assert report.machine_label("cpu", 2, None) == "2xCPU"


# --------------------------------------------------------------------------- real data

def test_jpeg_folder_is_generated_once_in_imagefolder_layout(tmp_path):
    from multigpu.bench import realdata
    from multigpu.train.data.datasets import load_data

    folder = realdata.ensure_image_folder(tmp_path, 30, 16, workers=1)
    again = realdata.ensure_image_folder(tmp_path, 20, 16, workers=1)
    assert again == folder and (folder / "manifest.json").exists()
    data = load_data(f"folder:{folder}", input_kind="image", image_size=16)
    assert len(data.train) == 30 and data.num_outputs == realdata.CLASSES
    assert data.train[0][0].shape == (3, 16, 16)


def test_flops_are_counted_once_per_model_and_scaled_by_the_batch():
    tasks = [Task("multigpu-single", "mlp", b, 1, 8, "fp32", "synthetic", 1000, 1, 1, 1)
             for b in (4, 16)]
    flops = runner.count_flops(tasks)
    assert flops[report.flops_key(tasks[0])] == stats.train_step_flops("mlp", (3, 8, 8), 1000, 4)
    assert flops[report.flops_key(tasks[1])] == 4 * flops[report.flops_key(tasks[0])]


# --------------------------------------------------------------------------- failures

def _fake_launch(monkeypatch, outcomes):
    """launch() that, as the worker does, writes a begin record for each of the first `begun` tasks
    of each job (default: `done`, plus the one that failed when `rc` is not 0) and a result for
    each of the first `done`, then returns `rc`. outcomes: (done, rc) or (done, rc, begun)."""
    import multigpu.launcher.launch

    calls = []

    def launch(cmd, plan, opts):
        job = json.loads(open(cmd[-1]).read())
        done, rc, *begun = outcomes[len(calls)]
        begun = begun[0] if begun else done + (rc != 0)
        calls.append([t["method"] for t in job["tasks"]])
        with open(f"{job['results_dir']}/rank0.jsonl", "w") as f:
            for i, t in enumerate(job["tasks"][:begun]):
                key = Task(**t).key
                f.write(json.dumps({"kind": "begin", "phase": "build", "key": key}) + "\n")
                if i < done:
                    f.write(json.dumps({"kind": "task", "key": key, "rank": 0}) + "\n")
        return rc

    monkeypatch.setattr(multigpu.launcher.launch, "launch", launch)
    return calls


def _group():
    return spec.Group(1, 0, [Task(m, "mlp", 4, 1, 8, "fp32", "synthetic", 1000, 1, 1, 1)
                             for m in ("multigpu-single", "ddp", "accelerate", "fabric")])


def test_a_failed_task_is_noted_and_the_rest_of_its_group_runs_again(monkeypatch, tmp_path):
    calls = _fake_launch(monkeypatch, [(1, 1), (2, 0)])  # ddp crashes; a new launch does the rest
    rep, got, saves = {"launches": [], "notes": []}, runner.Collected(), []
    go_on = runner.run_group(0, _group(), DevicePlan("cpu", (), 1), tmp_path, rep, got,
                             lambda: saves.append(1))
    assert go_on and calls == [["multigpu-single", "ddp", "accelerate", "fabric"],
                               ["accelerate", "fabric"]]
    assert len(got.records) == 3 and len(saves) == 2
    assert len(rep["notes"]) == 1 and rep["notes"][0].startswith("ddp x1 mlp batch 4 failed")


def test_a_task_failing_while_its_set_is_built_is_blamed_not_the_first_unfinished(monkeypatch,
                                                                                   tmp_path):
    # One set of four: single and ddp built and warmed up, accelerate crashes in its build.
    calls = _fake_launch(monkeypatch, [(0, 1, 3), (3, 0)])
    rep, got = {"launches": [], "notes": []}, runner.Collected()
    assert runner.run_group(0, _group(), DevicePlan("cpu", (), 1), tmp_path, rep, got, lambda: None)
    assert calls == [["multigpu-single", "ddp", "accelerate", "fabric"],
                     ["multigpu-single", "ddp", "fabric"]]
    assert len(got.records) == 3 and rep["notes"][0].startswith("accelerate x1 mlp batch 4 failed")


def _write_records(folder, rank, records):
    with open(folder / f"rank{rank}.jsonl", "w") as f:
        f.write(json.dumps({"kind": "meta"}) + "\n")
        for kind, task, *phase in records:
            rec = {"kind": kind, "key": task.key, "rank": rank}
            if kind == "begin":
                rec["phase"] = phase[0] if phase else "build"
            f.write(json.dumps(rec) + "\n")


def test_the_failure_is_blamed_on_the_task_begun_last_without_a_result(tmp_path):
    t1, t2, t3, t4 = _group().tasks
    _write_records(tmp_path, 0, [("begin", t1), ("task", t1), ("begin", t2)])
    got, _ = runner.read_records(tmp_path)
    assert list(got) == [t1.key], "begin records are no results"
    assert runner.blamed(tmp_path, [t2, t3, t4]) == (t2, {"kind": "begin", "key": t2.key,
                                                          "rank": 0, "phase": "build"})
    # interleaved: t1 and t2 built, nothing written yet; t2's build failed, not t1
    _write_records(tmp_path, 0, [("begin", t1), ("begin", t2)])
    assert runner.blamed(tmp_path, [t1, t2, t3, t4])[0] is t2
    # ranks that disagree: the earliest unfinished task in job order
    _write_records(tmp_path, 1, [("begin", t1), ("begin", t2), ("begin", t3)])
    assert runner.blamed(tmp_path, [t1, t2, t3, t4])[0] is t2
    # no rank had begun a task (a crash at start-up): the first, as before
    (tmp_path / "rank1.jsonl").unlink()
    _write_records(tmp_path, 0, [])
    assert runner.blamed(tmp_path, [t3, t4]) == (t3, None)


def test_a_failure_in_interleaved_trials_drops_that_set_and_the_next_sets_still_run(
        monkeypatch, tmp_path):
    import multigpu.launcher.launch

    t1, t2, t3, t4 = tasks = _group().tasks
    tasks[2:] = [dataclasses.replace(t, batch_size=8) for t in (t3, t4)]  # a second set
    calls = []

    def launch(cmd, plan, opts):  # the first set fails in its trials, then all goes well
        job = json.loads(open(cmd[-1]).read())
        keys = [Task(**t).key for t in job["tasks"]]
        calls.append(keys)
        with open(f"{job['results_dir']}/rank0.jsonl", "w") as f:
            if len(calls) == 1:
                for k in keys[:2]:
                    f.write(json.dumps({"kind": "begin", "phase": "build", "key": k}) + "\n")
                f.write(json.dumps({"kind": "begin", "phase": "trials", "key": keys[0],
                                    "keys": keys[:2]}) + "\n")
                return 1
            for k in keys:
                f.write(json.dumps({"kind": "task", "key": k, "rank": 0}) + "\n")
        return 0

    monkeypatch.setattr(multigpu.launcher.launch, "launch", launch)
    group = spec.Group(1, 0, tasks)
    rep, got = {"launches": [], "notes": []}, runner.Collected()
    assert runner.run_group(0, group, DevicePlan("cpu", (), 1), tmp_path, rep, got, lambda: None)
    assert calls[1] == [tasks[2].key, tasks[3].key], "the failed set is not retried"
    assert set(got.records) == {tasks[2].key, tasks[3].key}
    assert rep["notes"][0].startswith("multigpu-single x1 mlp batch 4 and the 1 other method(s) "
                                      "timed in turns with it failed (exit code 1)")


def test_a_launch_stopped_by_sigterm_stops_the_bench(monkeypatch, tmp_path):
    _fake_launch(monkeypatch, [(2, 143)])
    rep, got = {"launches": [], "notes": []}, runner.Collected()
    assert not runner.run_group(0, _group(), DevicePlan("cpu", (), 1), tmp_path, rep, got, lambda: None)
    assert len(got.records) == 2 and "stopped by a signal" in rep["notes"][0]


def test_the_bench_flags_are_pinned():
    from multigpu.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["bench"]
    flags = {s for a in sub._actions for s in a.option_strings if s.startswith("--")}
    assert flags == {"--help", "--debug", "--model", "--batch-size", "--precision", "--gpus",
                     "--methods", "--data", "--steps", "--warmup", "--trials", "--dp-steps",
                     "--image-size", "--devices", "--min-free-memory", "--out", "--data-dir",
                     "--images", "--compile"}


def test_flags_become_settings_and_bad_values_are_usage_errors():
    from multigpu.cli import build_parser
    from multigpu.cli.bench import settings_from_args

    parse = build_parser().parse_args
    s = settings_from_args(parse(["bench", "--model", "mlp,cnn", "--batch-size", "8,16",
                                  "--gpus", "1,2", "--methods", "multigpu-ddp,ddp"]))
    assert (s.models, s.batch_sizes, s.gpus, s.methods) == (("mlp", "cnn"), (8, 16), (1, 2),
                                                            ("multigpu-ddp", "ddp"))
    assert settings_from_args(parse(["bench"])).gpus is None
    with pytest.raises(UsageError, match="--steps 0 must be at least 1"):
        settings_from_args(parse(["bench", "--steps", "0"]))
    with pytest.raises(UsageError, match="--batch-size"):
        settings_from_args(parse(["bench", "--batch-size", "x"]))


def test_data_takes_one_kind_or_both_and_compile_takes_an_optional_mode():
    from multigpu.cli import build_parser
    from multigpu.cli.bench import settings_from_args

    parse = build_parser().parse_args
    default = settings_from_args(parse(["bench"]))
    assert (default.data, default.compile) == (("synthetic",), None)
    both = settings_from_args(parse(["bench", "--data", "synthetic,real", "--compile"]))
    assert (both.data, both.compile) == (("synthetic", "real"), "default")
    graphs = parse(["bench", "--compile", "reduce-overhead", "--methods", "multigpu-ddp"])
    assert settings_from_args(graphs).compile == "reduce-overhead"
    assert settings_from_args(parse(["bench", "--data", "real, synthetic"])).data == both.data
    with pytest.raises(UsageError, match=r"--data bogus: unknown kind 'bogus'; choose from "
                                         r"synthetic,real,real-cpu,real-gpu or folder:PATH"):
        settings_from_args(parse(["bench", "--data", "bogus"]))
    mine = settings_from_args(parse(["bench", "--data", "real-cpu,folder:~/imgs,synthetic"]))
    assert (mine.data, mine.folder) == (("synthetic", "real", "real-cpu"), "~/imgs")
    assert (both.folder, settings_from_args(parse(["bench", "--data", "real-gpu"])).data) == (None, ("real-gpu",))
    with pytest.raises(UsageError, match=r"--data folder:a,folder:b: name one folder"):
        settings_from_args(parse(["bench", "--data", "folder:a,folder:b"]))
    with pytest.raises(UsageError, match="--compile .*--warmup 1 or more"):
        settings_from_args(parse(["bench", "--compile", "--warmup", "0"]))


def test_real_kinds_are_one_folder_decoded_three_ways():
    from multigpu.bench.spec import Task

    kinds = [Task("multigpu-single", "resnet50", 8, 1, 224, "auto", "folder:/d", 10, 1, 1, 1, decode=d)
             for d in ("auto", "cpu", "gpu")]
    assert [t.data_kind for t in kinds] == ["real", "real-cpu", "real-gpu"]
    assert len({t.key for t in kinds}) == 3
    assert [t.describe() for t in kinds] == [
        "multigpu-single x1 resnet50 batch 8, real data",
        "multigpu-single x1 resnet50 batch 8, real data, CPU decode",
        "multigpu-single x1 resnet50 batch 8, real data, GPU decode"]


def test_nccl_max_ctas_below_one_is_refused_when_the_options_are_made():
    from multigpu.core.strategies import DDPOptions

    with pytest.raises(UsageError, match=r"DDPOptions\(nccl_max_ctas=0\): give at least 1"):
        DDPOptions(nccl_max_ctas=0)
    assert DDPOptions(nccl_max_ctas=1).nccl_max_ctas == 1


def test_real_gpu_is_skipped_on_cpu_and_folder_is_not_given_beside_real():
    from multigpu.bench.spec import parse_data, unavailable_reason

    assert unavailable_reason("multigpu-single", "cpu", "real-gpu") == (
        "--data real-gpu decodes on GPUs; on CPU use --data real-cpu")
    with pytest.raises(UsageError, match=r"--data real,folder:x: folder:PATH is the real kind on your "
                                         r"folder, in place of the generated images; give one"):
        parse_data("real,folder:x")


def test_the_title_names_the_users_folder():
    assert report.data_title({"settings": {"data": ["synthetic", "real"], "folder": "/data/imgs"}}) == (
        "synthetic and real data (real: /data/imgs)")
    assert report.data_title({"settings": {"data": "synthetic"}}) == "synthetic data"  # an old report
