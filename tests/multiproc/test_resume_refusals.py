"""A resume that cannot fit the run it goes on from leaves that run's record as it was (issue 40,
item 1): data of other shapes is refused before any process starts, in one line naming what
differs; a resume that fails in the processes anyway (a run from before the shapes were kept)
rewrites nothing, since config.json is written once the resumed run has trained a step."""
import json
import shutil

import pytest

from .conftest import multigpu

pytestmark = pytest.mark.slow

TRAIN = ["train", "--model", "cnn", "--data", "digits", "--epochs", "1", "--batch-size", "64",
         "--workers", "0", "--devices", "cpu:1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "digits"
    proc = multigpu(*TRAIN, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def record(run) -> dict:
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and "logs" not in p.parts}


@pytest.mark.smoke
def test_other_data_is_refused_before_any_process_starts_naming_what_differs(trained, tmp_path):
    run = tmp_path / "digits"
    shutil.copytree(trained, run)
    before = record(run)
    proc = multigpu("train", "--model", "cnn", "--data", "synthetic:500", "--image-size", "8",
                    "--epochs", "2", "--devices", "cpu:1", "--resume", run, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        f"multigpu: error: --resume {sorted((run / 'checkpoints').glob('*.pt'))[-1]}: its model was "
        "trained on samples shaped (1, 8, 8) with 10 outputs, and this run's data gives (3, 8, 8) "
        "with 10 (--data digits then, --data synthetic:500 now; no --image-size then, "
        "--image-size 8 now); give the run's own --data and --image-size, or train a new run "
        "without --resume")
    assert "Traceback" not in proc.stderr and "started" not in proc.stderr
    assert record(run) == before


def test_a_resume_that_fails_in_the_processes_rewrites_nothing_of_the_run(trained, tmp_path):
    """config.json without the shapes (a run of an older multigpu): no check before the launch,
    the rank stops on the weights that do not fit, and config.json, checkpoints and metrics stay."""
    run = tmp_path / "digits"
    shutil.copytree(trained, run)
    config = json.loads((run / "config.json").read_text())
    del config["input_shape"], config["num_outputs"]
    (run / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    before = record(run)
    proc = multigpu("train", "--model", "cnn", "--data", "synthetic:500", "--image-size", "8",
                    "--epochs", "2", "--devices", "cpu:1", "--resume", run, "--out", run, cwd=tmp_path)
    assert proc.returncode != 0 and "size mismatch" in proc.stderr, proc.stderr[-3000:]
    assert record(run) == before
