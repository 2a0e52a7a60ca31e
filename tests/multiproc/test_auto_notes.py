"""What --auto leaves unsplit, said as users meet it on 2 CPU processes: the note of `multigpu run
--auto` at the start of training (rank 0, once), doctor --auto's findings for the same scripts,
and the warning of `multigpu run` without --auto before it starts a one-process script N times."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .conftest import multigpu
from .test_doctor_cli import DDP_SCRIPT

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"

NO_OPTIMIZER = ("multigpu: note: --auto: the script's first backward came with no torch.optim "
                "optimizer holding its parameters: --auto averages the gradients of an "
                "optimizer's parameters only, so nothing is averaged")
WHOLE_JOB = (f"{NO_OPTIMIZER} and nothing split: each of the 2 processes trains its own copy of "
             "the whole job, the work of one process done 2 times (every process starts from "
             "rank 0's seeds, so each trains the same model), and rank 0's is the one kept "
             "(printed, saved); to make it "
             "data-parallel, update the weights with a torch.optim optimizer, and read the data "
             "through DataLoader(TensorDataset(x, y), batch_size=..., shuffle=True): batches made "
             "otherwise (a tensor sliced in a loop, a get_batch()) are not split")
OWN_SHARE = (f"{NO_OPTIMIZER}: each of the 2 processes trains a model of its own on its 1/2 of "
             "the split DataLoader (2 different models), and rank "
             "0's is the one kept (printed, saved); to make it data-parallel, update the weights "
             "with a torch.optim optimizer")
SLICED = ("multigpu: note: --auto: the script's first optimizer step came before any DataLoader: "
          "batches made otherwise (a tensor sliced in a loop, a get_batch()) are not split, so "
          "each of the 2 processes trains on all of the data, the work of one process done 2 "
          "times; --auto splits a DataLoader with shuffle=True: read the tensors through "
          "DataLoader(TensorDataset(x, y), batch_size=..., shuffle=True)")


def notes(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("multigpu: note:")]


def rank1_stderr(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in tmp_path.glob("runs/logs/*/*/attempt_0/1/stderr.log"))


@pytest.mark.parametrize("args, said", [((), WHOLE_JOB), pytest.param(
    ("grad", "split"), OWN_SHARE, marks=pytest.mark.extended)],
                         ids=["backward, sliced tensor", "autograd.grad, split loader"])
def test_training_without_an_optimizer_is_said_once_at_its_first_backward(tmp_path, args, said):
    """A hand-written SGD (p.data.add_) ran the whole job on every rank, unseeded N models of
    which rank 0's is kept, without a word."""
    shutil.copy(SCRIPTS / "auto_notes_manual_sgd.py", tmp_path)
    proc = multigpu("run", "--auto", "--devices", "cpu:2", "auto_notes_manual_sgd.py", *args,
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert notes(proc) == [said]
    assert "multigpu: note:" not in rank1_stderr(tmp_path)


def test_batches_sliced_from_a_tensor_are_said_unsplit_with_what_splits_them(tmp_path):
    shutil.copy(SCRIPTS / "auto_notes_sliced.py", tmp_path)
    proc = multigpu("run", "--auto", "--devices", "cpu:2", "auto_notes_sliced.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert notes(proc) == [SLICED]


def doctor_lines(tmp_path: Path, script: str, *args: str) -> list[str]:
    shutil.copy(SCRIPTS / script, tmp_path)
    proc = multigpu("doctor", *args, "--devices", "cpu:2", script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_doctor_takes_the_batch_from_the_model_not_from_a_transform_the_dataset_calls(tmp_path):
    """A Normalize (an nn.Module) in the Dataset's __getitem__ was taken for the model's first
    forward: '1 samples per rank' (here 3: the image's channels)."""
    out = doctor_lines(tmp_path, "auto_notes_transform.py", "--auto")
    assert ("ok    batch          4 samples per rank in the model's first forward; 8 over the 2 "
            "ranks") in out


@pytest.mark.extended  # a second test of its change; the default tier keeps the first
def test_doctor_says_the_data_is_whole_on_every_rank_where_nothing_splits_it(tmp_path):
    out = doctor_lines(tmp_path, "auto_notes_sliced.py", "--auto")
    assert ("warn  auto data      the model's batches came from no DataLoader (a tensor sliced in "
            "a loop, a get_batch()): --auto splits only a DataLoader with shuffle=True, so each of "
            "the 2 ranks reads all of the data; give it DataLoader(TensorDataset(x, y), "
            "batch_size=..., shuffle=True)") in out
    assert ("ok    batch          8 samples per rank in the model's first forward, the whole data "
            "on each of the 2 ranks: no DataLoader read for training was split") in out
    assert not [line for line in out if "over the 2 ranks" in line]


@pytest.mark.extended
def test_doctor_says_nothing_was_averaged_for_a_script_without_an_optimizer(tmp_path):
    out = doctor_lines(tmp_path, "auto_notes_manual_sgd.py", "--auto")
    assert ("warn  auto gradients the script ended with no torch.optim optimizer step: --auto "
            "averages the gradients of what an optimizer holds, so nothing was averaged and each "
            "of the 2 ranks trained a model of its own (rank 0's is the one kept); update the "
            "weights with a torch.optim optimizer") in out
    assert ("ok    batch          8 samples per rank in the model's first forward, the whole data "
            "on each of the 2 ranks: no DataLoader read for training was split") in out


def one_process_warning(script: str, n: int) -> str:
    return (f"{script} forms no process group (no torch.distributed."
            f"init_process_group): each of the {n} processes runs the whole script alone, {n} "
            "independent full trainings that each write the same files; run it with --auto to "
            f"make it data-parallel unmodified (multigpu run --auto {script})")


def test_run_without_auto_warns_before_starting_a_one_process_script_twice(tmp_path):
    """N independent full copies of a one-device script, each writing the same files, ran with
    no word; not for 1 process, nor for a script that forms its process group."""
    shutil.copy(SCRIPTS / "auto_notes_sliced.py", tmp_path)
    proc = multigpu("run", "--devices", "cpu:2", "auto_notes_sliced.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert lines[0] == "multigpu: warning: " + one_process_warning("auto_notes_sliced.py", 2), \
        "said before the launch"
    assert lines.count(lines[0]) == 1
    one = multigpu("run", "--devices", "cpu:1", "auto_notes_sliced.py", cwd=tmp_path)
    assert one.returncode == 0 and "forms no process group" not in one.stderr, one.stderr
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)  # distributed: its own init_process_group
    ddp = multigpu("run", "--devices", "cpu:2", "ddp.py", cwd=tmp_path)
    assert ddp.returncode == 0 and "multigpu: warning:" not in ddp.stderr, ddp.stderr[-3000:]


@pytest.mark.extended  # a second test of its change; the default tier keeps the first
def test_doctor_names_auto_as_the_fix_of_a_one_process_script_run_twice(tmp_path):
    shutil.copy(SCRIPTS / "auto_notes_transform.py", tmp_path)
    proc = multigpu("doctor", "--devices", "cpu:2", "--", "auto_notes_transform.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert f"warn  process group  {one_process_warning('auto_notes_transform.py', 2)}" in out
    assert ("warn  sampler        auto_notes_transform.py:35: the DataLoader has no "
            "DistributedSampler (RandomSampler): each of the 2 ranks goes through all 64 samples "
            "(8 batches), repeating the others' work; fix: `multigpu run --auto` (the script forms "
            "no process group: --auto makes it data-parallel unmodified), or DataLoader(ds, "
            "sampler=DistributedSampler(ds)) and sampler.set_epoch(epoch) each epoch, or "
            "multigpu's rt.prepare(loader)") in out
    assert ("ok    batch          8 samples per rank in the model's first forward, the whole data "
            "on each of the 2 ranks: no DataLoader read for training was split") in out
