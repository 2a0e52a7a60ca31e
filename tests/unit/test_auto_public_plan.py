"""benchmarks/auto_public_scripts.py --compare: which runs, with which arguments, and how their
numbers are read (no run is started here)."""
import argparse
from pathlib import Path

import pytest

from multigpu.auto.data.loaders import per_process_batch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import auto_public_report as report
    import auto_public_runs as runs
    import auto_public_scripts as scripts

    return scripts, runs, report


def compare_args(scripts, argv=()):
    """main()'s parsed arguments, without running anything."""
    seen = {}

    def stop(args, call):
        seen["args"] = args
        raise SystemExit(0)

    original = scripts.plan
    scripts.plan = stop
    try:
        with pytest.raises(SystemExit):
            scripts.main(["--compare", "--scripts", str(BENCH), *argv])
    finally:
        scripts.plan = original
    return seen.get("args")


def test_compare_runs_every_mode_on_each_count_in_turns(bench, tmp_path, monkeypatch):
    scripts, runs, _ = bench
    monkeypatch.setattr(runs, "check_scripts", lambda pins, folder: {
        n: {"unmodified": True} for n in pins})
    args = compare_args(scripts, ["--out", str(tmp_path)])
    jobs = scripts.plan(args, tmp_path / "call-1")
    assert [j.cwd.name for j in jobs] == [
        "1gpu-1", "loader-1", "auto-2", "ddp-2", "per-gpu-2", "loader-2",
        "auto-4", "ddp-4", "per-gpu-4", "loader-4"]
    data = str(tmp_path / "data" / "imagenet-40960x512")
    by = {j.cwd.name: j for j in jobs}
    assert by["1gpu-1"].args == [data, "-a", "resnet18", "--epochs", "1", "-b", "256",
                                 "-j", "10", "-p", "1"]
    ddp = by["ddp-4"]
    ddp.port = 29999
    assert runs.command(ddp, cpu=False)[2:] == [
        data, "-a", "resnet18", "--epochs", "4", "-b", "256", "-j", "40", "-p", "1",
        "--multiprocessing-distributed", "--world-size", "1", "--rank", "0",
        "--dist-url", "tcp://127.0.0.1:29999", "--dist-backend", "nccl"]
    assert runs.command(by["per-gpu-2"], cpu=False)[3:7] == ["run", "--auto", "--auto-batch",
                                                            "per-gpu"]
    assert by["loader-4"].args == [data, "--procs", "4", "-b", "256", "-j", "10",
                                   "--epochs", "4", "--warmup", "5"]
    assert [by[f"per-gpu-{n}"].global_batch for n in (2, 4)] == [512, 1024]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_scripts_own_mode_gets_the_per_process_batch_and_workers_of_auto(bench, n):
    """main.py (--multiprocessing-distributed, one GPU per process) divides -b and -j itself:
    batch int(b / N), workers int((j + N - 1) / N). --auto gives each process b / N and the
    script's j: the ddp run's -j is j * N."""
    scripts, runs, _ = bench
    job = runs.Job("imagenet", Path("main.py"), Path("/x/ddp"), n, "ddp", None, True)
    job.data_dir = Path("/data")
    args = argparse.Namespace(devices_kind="gpu", imagenet_epochs_per_gpu=1, imagenet_batch=256,
                              imagenet_workers=10, imagenet_arch="resnet18", warmup=5)
    given = scripts.imagenet_args(job, args, cpu=False)
    b, j = int(given[given.index("-b") + 1]), int(given[given.index("-j") + 1])
    assert int(b / n) == per_process_batch(256, n, "global") == 256 // n
    assert int((j + n - 1) / n) == 10


def test_ddp_throughput_reads_every_ranks_lines_and_per_gpu_counts_the_global_batch(bench):
    _, runs, _ = bench
    lines = "".join(f"Epoch: [0][{i:3d}/160]\tTime  {t:.3f} ( 0.1)\tData 0.0\n"
                    for i in range(1, 9) for t in (0.5 if i <= 5 else 0.1, 0.5 if i <= 5
                                                   else 0.3))
    assert runs.throughput(lines, 256, 5, printers=2) == {
        "batches_timed": 3, "mean_batch_s": 0.2, "seconds_timed": 0.6, "images_per_s": 1280.0}


def test_compare_lines_put_each_modes_speedup_side_by_side(bench):
    _, _, report = bench

    def run(name, mode, n, rate):
        return {"script": "imagenet", "run": name, "mode": mode, "devices": n, "accuracy": None,
                "rc": 0, "saved_once": True, "samples": {"once_per_epoch": True},
                "throughput": {"images_per_s": rate}}

    results = [run("1gpu-1", "1gpu", 1, 1000.0), run("loader-1", "loader", 1, 1200.0),
               run("auto-4", "auto", 4, 2400.0), run("ddp-4", "ddp", 4, 2500.0),
               run("per-gpu-4", "per-gpu", 4, 3600.0), run("loader-4", "loader", 4, 2700.0)]
    summary = report.summarise(results)
    assert report.compare_lines(summary) == [
        "imagenet 1 process(es) vs the one-GPU run's 1000.0 img/s: loader 1.2x",
        "imagenet 4 process(es) vs the one-GPU run's 1000.0 img/s (target 3.5x): auto 2.4x, "
        "ddp 2.5x, per-gpu 3.6x, loader 2.7x"]


def test_an_unknown_mode_is_refused_in_one_line(bench, capsys):
    scripts, _, _ = bench
    with pytest.raises(SystemExit) as stop:
        scripts.main(["--imagenet-modes", "auto,dp"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: --imagenet-modes: dp is not one of auto,per-gpu,ddp,loader")


def test_nccl_channels_are_counted_by_transport(bench):
    _, runs, _ = bench
    log = ("h:11980:12549 [2] NCCL INFO Channel 06/0 : 2[2] -> 3[3] via P2P/CUMEM\n"
           "h:11980:12549 [2] NCCL INFO Channel 07/0 : 2[2] -> 3[3] via P2P/CUMEM\n"
           "h:37105:37384 [0] NCCL INFO Channel 01/0 : 0[80] -> 1[90] via SHM/direct/direct\n"
           "Epoch: [0][  1/160]\tTime  0.500 ( 0.5)\n")
    found = runs.TRANSPORT.findall(log)
    assert found == ["P2P/CUMEM", "P2P/CUMEM", "SHM/direct/direct"]


@pytest.fixture
def check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import auto_corpus_check as check

    return check


def corpus_run(rc=0, metric=1.0, files=None, passes=(), weights=None, stepped=(0, 1),
               error_lines=(), traceback=False, devices=2, mode="auto"):
    same = [["module:Linear", 4, "aa"]]
    return {"script": "gan", "run": "auto-2" if mode == "auto" else "1proc-1", "mode": mode,
            "devices": devices, "rc": rc, "wall_s": 1.0, "metric": metric,
            "files": files or {}, "passes": list(passes),
            "weights": weights if weights is not None else {r: same for r in range(devices)},
            "stepped": list(stepped), "error_lines": list(error_lines), "traceback": traceback,
            "last_lines": ["x"]}


def test_a_file_renamed_into_place_counts_for_its_name_and_each_rank_that_wrote_it(check,
                                                                                   tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "0.png").write_bytes(b"png")
    (tmp_path / "model.pt").write_bytes(b"pt")
    tmp = str(tmp_path / "tmpabc")
    events = {0: [{"kind": "write", "path": tmp, "how": "open"},
                  {"kind": "rename", "src": tmp, "dst": str(tmp_path / "model.pt")},
                  {"kind": "write", "path": str(tmp_path / "images" / "0.png"), "how": "open"},
                  {"kind": "write", "path": str(tmp_path / "record" / "x.jsonl"), "how": "open"}],
              1: [{"kind": "write", "path": str(tmp_path / "images" / "0.png"), "how": "open"},
                  {"kind": "write", "path": "/elsewhere/y", "how": "open"}]}
    assert check.written(events, tmp_path) == {"images/0.png": [0, 1], "model.pt": [0]}


def test_a_file_every_rank_wrote_makes_the_run_wrong(check):
    one = corpus_run(mode="1gpu", devices=1, files={"images/0.png": {"ranks": [0], "broken": None}})
    torn = corpus_run(files={"images/0.png": {"ranks": [0, 1], "broken": None}})
    assert check.verdict(torn, [one] * 3) == ("wrong", ["images/0.png written by ranks [0, 1]"])
    once = corpus_run(files={"images/0.png": {"ranks": [0], "broken": None}})
    assert check.verdict(once, [one] * 3) == ("right", [])


def test_refused_means_one_error_line_before_any_step(check):
    one = corpus_run(mode="1gpu", devices=1)
    line = "multigpu: error: train.py calls torch.distributed.init_process_group itself"
    refused = corpus_run(rc=2, metric=None, stepped=(), error_lines=[line])
    assert check.verdict(refused, [one] * 3) == ("refused", [line])
    late = corpus_run(rc=2, metric=None, stepped=(0,), error_lines=[line])
    assert check.verdict(late, [one] * 3) == (
        "wrong", [f"exit 2 after 1 rank(s) stepped: {line}"])


def test_epochs_are_the_data_a_one_process_run_shuffles_whatever_sampler_auto_gives(check):
    """--auto reads a shuffled loader through a sampler of its own: the one-process run's
    RandomSampler says which data set is trained on; a peek (incomplete pass) is no epoch."""
    def p(dataset, n, sampler, complete=True, repeated=0):
        return {"dataset": dataset, "pass": n, "len": 8, "ranks": 1, "samplers": [sampler],
                "complete": complete, "fetched": 8 + repeated, "missing": 0,
                "repeated": repeated}

    one = corpus_run(mode="1gpu", devices=1, passes=[
        p("MNIST|data|True", 0, "RandomSampler", complete=False),
        p("MNIST|data|True", 1, "RandomSampler"), p("MNIST|data|False", 0, "SequentialSampler")])
    auto = corpus_run(passes=[p("MNIST|data|True", 0, "SequentialSampler", complete=False),
                              p("MNIST|data|True", 1, "SequentialSampler"),
                              p("MNIST|data|False", 0, "SequentialSampler", repeated=8)])
    assert check.verdict(auto, [one] * 3) == ("right", [])
    twice = corpus_run(passes=[p("MNIST|data|True", 1, "SequentialSampler", repeated=8)])
    verdict, (why,) = check.verdict(twice, [one] * 3)
    assert verdict == "wrong" and why.startswith("samples not once per epoch: 1 of 1 epochs")


def test_weights_that_differ_between_ranks_make_the_run_wrong(check):
    one = corpus_run(mode="1gpu", devices=1)
    run = corpus_run(weights={0: [["module:Linear", 4, "aa"]], 1: [["module:Linear", 4, "bb"]]})
    assert check.verdict(run, [one] * 3) == (
        "wrong", ["weights differ between ranks: 1 of 1 hashes, e.g. module:Linear (4 values)"])


def test_the_metric_is_every_ranks_lines_rank_0_s_kept_beside(check, tmp_path):
    """Each rank prints the loss of its part of the global batch: the metric is the mean of the
    ranks' means (rank 1's from its stdout.log, a later attempt's replacing an earlier one's)."""
    entry = check.corpus.Entry("x", check.corpus.Pin("a/b", "0" * 40, "t.py", "0"),
                               r"^D loss: ([\d.]+)$", "D loss", metric_mean_of_last=2)
    for attempt, lines in (("attempt_0", "D loss: 9\n"), ("attempt_1", "D loss: 5\nD loss: 3\n")):
        folder = tmp_path / "ranklogs" / "multigpu-x" / attempt / "1"
        folder.mkdir(parents=True)
        (folder / "stdout.log").write_text(lines)
    rank0 = "D loss: 7\nmultigpu: note: x\nD loss: 1\nD loss: 2\n"
    assert check.rank_metrics(entry, rank0, tmp_path / "ranklogs") == {0: 1.5, 1: 4.0}
    assert check.rank_metrics(entry, rank0, tmp_path / "none") == {0: 1.5}


def test_a_baseline_s_one_process_range_replaces_the_call_s_own(check):
    one = corpus_run(mode="1gpu", devices=1, metric=0.5)
    runs = [one, corpus_run(metric=0.45)]
    inside = check.summarise(runs, {"gan": [0.44, 0.46]})["gan"]
    assert inside["one_process"] == [0.44, 0.46] and inside["one_process_here"] == [0.5]
    assert inside["auto-2"]["verdict"] == "right"
    outside = check.summarise(runs)["gan"]["auto-2"]
    assert outside["verdict"] == "wrong" and outside["reasons"] == [
        "metric 0.45 outside the one-process range [0.5, 0.5]"]


def test_auto_runs_plans_that_many_runs_of_each_count(check, tmp_path):
    jobs = check.plan(["gan"], tmp_path, tmp_path / "call", [2], ones=1, autos=3)
    assert [(j.cwd.name, j.devices) for j in jobs] == [
        ("1proc-1", 1), ("auto-2-1", 2), ("auto-2-2", 2), ("auto-2-3", 2)]
