"""benchmarks/auto_public_scripts.py --compare: which runs, with which arguments, and how their
numbers are read (no run is started here)."""
import argparse
from pathlib import Path

import pytest

from multigpu.auto.loaders import per_process_batch

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
