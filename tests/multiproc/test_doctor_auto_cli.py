"""`multigpu doctor --auto script.py` as a user runs it on 2 CPU processes: what --auto will
change, line by line, then the script's first step under --auto, where refusals are judged."""
import shutil
import textwrap
from pathlib import Path

import pytest

from .conftest import multigpu

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"


def run_lines(stdout: str) -> list[str]:
    """The lines after the reading of the source: what the run under --auto showed."""
    out = stdout.splitlines()
    return out[next(i for i, line in enumerate(out) if line.startswith("ok    auto run")) + 1:]


def test_the_tutorial_under_auto_is_split_and_stopped_after_its_first_step(tmp_path):
    shutil.copy(SCRIPTS / "auto_tutorial.py", tmp_path)
    proc = multigpu("doctor", "--auto", "--devices", "cpu:2", "auto_tutorial.py", "--batch", "8",
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert "ok    auto data      auto_tutorial.py:47: DataLoader(Indexed(48, 1), batch_size=args.ba" \
           "...: --auto: split over the processes" in proc.stdout
    assert any(line.startswith("ok    auto save      auto_tutorial.py:72: ") for line in out)
    assert any(line.startswith("ok    auto files     auto_tutorial.py:79: ") for line in out)
    ran = run_lines(proc.stdout)
    assert ran[0].startswith("ok    script run     ran on 2 ranks up to optimizer step 1 (")
    assert ran[1:4] == [
        "ok    unused params  every trainable parameter of the optimizer got a gradient in its "
        "first step (trap 6)",
        "ok    auto data      auto_tutorial.py:57: split by --auto: 6 batches per rank and epoch, "
        "each of its 48 samples once over the 2 ranks",
        "ok    batch          4 samples per rank in the model's first forward; 8 over the 2 ranks"]
    assert out[-1] == "17 checks: 0 failed, 0 warnings"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auto_tutorial.py"], "no model.pt: stopped"


def test_mnist_style_on_cpu_its_training_loader_is_found_unsplit_when_it_runs(tmp_path):
    shutil.copy(Path(__file__).parents[1] / "gpu/scripts/auto_mnist_style.py", tmp_path)
    proc = multigpu("doctor", "--auto", "--devices", "cpu:2", "auto_mnist_style.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert ("ok    auto data      auto_mnist_style.py:56: DataLoader(classes(1024, 1), "
            "**train_kwargs): whether it shuffles is decided when it runs") in proc.stdout
    assert ("warn  auto data      auto_mnist_style.py:63: a DataLoader read for training was not "
            "split (it does not shuffle): each of the 2 ranks reads all 1024 samples, the same "
            "batches; give it shuffle=True") in run_lines(proc.stdout)
    assert ("ok    batch          64 samples per rank in the model's first forward, the whole "
            "data on each of the 2 ranks: no DataLoader read for training was split") \
        in proc.stdout.splitlines(), "not '128 over the 2 ranks': nothing splits it on CPU"


PROCESS_GROUP = """\
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    def setup(distributed):
        if distributed:
            dist.init_process_group("gloo")

    setup(False)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4, shuffle=True)
    if len(__import__("sys").argv) > 1:
        dist.init_process_group("gloo")
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    """


def test_init_process_group_is_refused_where_it_runs_not_where_it_is_written(tmp_path):
    (tmp_path / "pg.py").write_text(textwrap.dedent(PROCESS_GROUP))
    warn = ("warn  auto refuses   pg.py:8: dist.init_process_group('gloo') (and line 15): if it "
            "runs, --auto refuses it there: the script is distributed already; run it with "
            "`multigpu run` without --auto")
    called = multigpu("doctor", "--auto", "--devices", "cpu:2", "pg.py", "distributed", cwd=tmp_path)
    assert called.returncode == 1, called.stdout + called.stderr[-3000:]
    assert warn in called.stdout.splitlines()
    assert run_lines(called.stdout)[0] == (
        "fail  script run     pg.py:15: ranks 0, 1 failed before optimizer step 1: pg.py calls "
        "torch.distributed.init_process_group itself, so it is distributed already and --auto "
        "would split it a second time; run it with `multigpu run pg.py` (without --auto)")
    # its data drawn unseeded (torch.randn): the same on every rank under --auto, said at its line
    assert ("ok    auto seeds     pg.py:13: torch.randn(16, 4): --auto: the same on every process: "
            "each starts from rank 0's seeds (torch, random, numpy), so data the script makes itself "
            "is the same everywhere, as in one process; the script's own seed still wins. Once "
            "training begins on a split DataLoader, each process draws its own numbers (noise, "
            "dropout) for its part of the batch, as one process draws one for each sample; torch, "
            "numpy and random each from a stream of its own"
            ) in called.stdout.splitlines(), called.stdout
    assert called.stdout.splitlines()[-1] == "10 checks: 1 failed, 1 warnings"
    not_called = multigpu("doctor", "--auto", "--devices", "cpu:2", "pg.py", cwd=tmp_path)
    assert not_called.returncode == 0, not_called.stdout + not_called.stderr[-3000:]
    assert warn in not_called.stdout.splitlines()
    assert run_lines(not_called.stdout)[0].startswith("ok    script run     ran on 2 ranks up to "
                                                      "optimizer step 1")


@pytest.mark.smoke
def test_auto_options_without_a_script_or_without_auto_are_one_line_errors(tmp_path):
    (tmp_path / "t.py").write_text("print(1)\n")
    (tmp_path / "t.sh").write_text("#!/bin/sh\necho 1\n")
    for args, words in ((["doctor", "--auto", "--devices", "cpu:2"],
                         "multigpu: error: --auto checks a one-device script for `multigpu run "
                         "--auto`: give it, e.g. multigpu doctor --auto train.py ARGS"),
                        (["doctor", "--auto-batch", "per-gpu", "t.py"],
                         "multigpu: error: --auto-batch per-gpu is a choice of --auto: add "
                         "--auto, or drop --auto-batch"),
                        (["doctor", "--auto", "--devices", "cpu:2", "t.sh"],
                         "multigpu: error: --auto makes a Python training script data-parallel, "
                         "and t.sh is not one (not .py, no python shebang); run it without --auto"),
                        (["doctor", "--auto", "nothing.py"],
                         f"multigpu: error: script 'nothing.py' not found (in {tmp_path}); give "
                         "the path of the script, e.g. multigpu doctor -- train.py, or -- -m "
                         "package.module"),
                        (["doctor", "--auto", "--scaling", "t.py"],
                         "multigpu: error: --scaling times a script's steps on 1 and on all the "
                         "devices as it is; under --auto it is another script: leave --scaling "
                         "out, or time the script without --auto, e.g. multigpu doctor --scaling "
                         "--steps 3 -- t.py")):
        proc = multigpu(*args, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [words], proc.stderr
        assert proc.stdout == "", "the error alone, without the report's headline"
