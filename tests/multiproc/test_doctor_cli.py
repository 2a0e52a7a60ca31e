"""`multigpu doctor` as a user runs it, and the checks that `train` and `run` fire themselves."""
import re
import subprocess
import sys
import time

import pytest

from .conftest import cli_env, multigpu

pytestmark = pytest.mark.slow


def run_with(env_extra: dict, *args, cwd=None):
    env = cli_env()
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "multigpu", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


def lines(stdout: str) -> dict[str, str]:
    """check name -> its line."""
    out = {}
    for line in stdout.splitlines():
        level, _, rest = line.partition("  ")
        if level.strip() in ("ok", "warn", "fail"):
            out[rest.split()[0] if rest.split()[0] not in ("last", "launch", "unused", "batch")
                else " ".join(rest.split()[:2])] = line
    return out


@pytest.mark.smoke
def test_a_train_setup_on_two_cpu_processes_passes_every_check_with_its_figures(tmp_path):
    proc = multigpu("doctor", "--model", "cnn", "--data", "digits", "--devices", "cpu:2",
                    "--batch-size", "32", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    found = lines(proc.stdout)
    assert set(found) >= {"launch env", "devices", "precision", "last step", "evaluation",
                          "unused params", "memory"}
    assert all(line.startswith("ok") for line in found.values()), proc.stdout
    assert ("1442 training samples, 32 per device x 2 devices = 64 per step: 23 steps; the last "
            "has 34 (17+17 per process)") in found["last step"]
    assert "each of the 355 validation samples counted once over 2 processes" in found["evaluation"]
    *_, summary, estimate = proc.stdout.splitlines()
    assert summary == "7 checks: 0 failed, 0 warnings"
    assert not list(tmp_path.iterdir()), "doctor writes nothing"
    said = re.fullmatch(r"estimate   ~(.+) an epoch of 23 steps \(training (.+), evaluation (.+), "
                        r"checkpoint (.+)\), ~(.+) for 10 epochs, ([\d.]+|under 0.01) CPU-hours on 2 "
                        r"CPU processes \(from (\d+) measured steps, ±\d+ %\); not in it: start-up, "
                        r"a first epoch's compile \(--compile\), --decode auto's trial, a cold page "
                        r"cache, the all-reduce between devices \(one device timed\)", estimate)
    assert said, estimate
    epoch, training, evaluation, checkpoint, total = map(seconds_of, said.groups()[:5])
    assert epoch == pytest.approx(training + evaluation + checkpoint, abs=0.15)
    assert total == pytest.approx(10 * epoch, rel=0.1, abs=1.0)  # each rounded as said
    assert 3 <= int(said.group(7)) <= 20


def test_scaling_of_train_options_is_one_report_without_the_bench_s_progress(tmp_path):
    """The bench's launches, their headers and rank 0's lines once came between the headline
    and the checks."""
    proc = multigpu("doctor", "--model", "mlp", "--data", "digits", "--devices", "cpu:2",
                    "--scaling", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    headline, *checks, summary, estimate, scaling = proc.stdout.splitlines()
    assert headline.startswith("multigpu doctor: checks before a run")
    names = [line[6:21].strip() for line in checks]
    # 2 CPU processes on a shared host may time under 60 % of linear: then a warning says so
    assert names in (["launch env", "devices", "precision", "last step", "evaluation", "unused params",
                      "memory"], ["launch env", "devices", "precision", "last step", "evaluation",
                                  "unused params", "memory", "scaling poor"]), proc.stdout
    assert summary == f"{len(names)} checks: 0 failed, {len(names) - 7} warnings", proc.stdout
    assert estimate.startswith("estimate   ~")
    assert re.match(r"scaling    [\d.]+x on 2 devices \(\d+ % of 2x one device\); measured: 1 device "
                    r"[\d.]+ ms a step, 2 devices [\d.]+ ms, 64 samples each, synthetic data "
                    r"\(multigpu bench\)", scaling), scaling
    assert proc.stderr == ""
    assert not list(tmp_path.iterdir()), "doctor writes nothing"


def seconds_of(said: str) -> float:
    """'4.2 s', '12 s', '3.5 min', '1.2 h' in seconds."""
    number, unit = said.split()
    return float(number) * {"s": 1, "min": 60, "h": 3600, "days": 86400}[unit]


def test_gpus_that_are_not_there_fail_with_the_fix_and_exit_1(tmp_path):
    proc = run_with({"CUDA_VISIBLE_DEVICES": ""}, "doctor", "--model", "mlp", "--devices", "2", cwd=tmp_path)
    assert proc.returncode == 1
    fail = lines(proc.stdout)["devices"]
    assert fail.startswith("fail") and "--devices 2: this machine has no GPU" in fail
    assert "use --devices cpu:N" in fail and "(trap 13)" in fail


def test_launch_variables_left_in_the_shell_are_named_and_train_refuses_them(tmp_path):
    stale = {"LOCAL_RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "29500"}
    proc = run_with(stale, "doctor", "--model", "mlp", "--devices", "cpu:1", "--no-step", cwd=tmp_path)
    warn = lines(proc.stdout)["launch env"]
    assert warn.startswith("warn") and "WORLD_SIZE=4" in warn and "unset" in warn
    train = run_with(stale, "train", "--model", "mlp", "--devices", "cpu:2", "--epochs", "1", cwd=tmp_path)
    assert train.returncode == 2
    assert train.stderr.strip().splitlines() == [
        "multigpu: error: MASTER_PORT=29500, WORLD_SIZE=4, LOCAL_RANK=0 set, but no launcher "
        "started this process (these are left from an earlier launch): unset MASTER_PORT "
        "WORLD_SIZE LOCAL_RANK (multigpu's launcher sets its own for every process)"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.smoke
def test_nothing_to_check_and_both_at_once_are_one_line_errors(tmp_path):
    (tmp_path / "t.py").write_text("print(1)\n")
    for args, words in ((["doctor", "--devices", "cpu:2"], "--model is required"),
                        (["doctor", "--model", "mlp", "--", "t.py"], "not both"),
                        (["doctor", "--", "missing.py"], "script 'missing.py' not found"),
                        (["doctor", "--trial-timeout", "0", "--", "t.py"], "--trial-timeout 0: give"),
                        (["doctor", "--scaling", "--", "t.py"], "--steps 1 times none; add --steps 3")):
        proc = multigpu(*args, cwd=tmp_path)
        assert proc.returncode == 2 and words in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


POST_002 = """\
import os
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

os.environ['MASTER_ADDR'] = 'localhost'
os.environ['MASTER_PORT'] = '29500'
dist.init_process_group("gloo")
sampler = DistributedSampler(list(range(10)))
print("rank", dist.get_rank(), len(list(sampler)))
dist.destroy_process_group()
"""


@pytest.mark.smoke
def test_a_script_is_read_for_its_traps_with_line_numbers(tmp_path):
    (tmp_path / "train.py").write_text(POST_002)
    (tmp_path / "run.sh").write_bytes(b"#!/bin/bash\r\npython train.py\r\n")
    proc = multigpu("doctor", "--devices", "cpu:2", "--", "train.py", "run.sh", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    port = next(line for line in out if "train.py:7" in line)
    assert port.startswith("fail  launch env") and "MASTER_PORT='29500'" in port
    assert "delete the line, or launch with --master-port 29500" in port
    assert any("train.py:9" in line and "set_epoch" in line for line in out)
    crlf = next(line for line in out if "run.sh" in line)
    assert crlf.startswith("fail  shell") and "sed -i 's/\\r$//' run.sh" in crlf


def test_run_says_the_traps_of_its_script_once_before_starting_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(POST_002.replace("os.environ['MASTER_ADDR'] = 'localhost'\n", "")
                      .replace("os.environ['MASTER_PORT'] = '29500'\n", ""))
    proc = multigpu("run", "--devices", "cpu:2", "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("multigpu: warning:")]
    assert warned == ["multigpu: warning: train.py:7: DistributedSampler without set_epoch: every "
                      "epoch sees the same order; fix: sampler.set_epoch(epoch) before each epoch"]


def test_run_refuses_a_script_that_sets_its_own_master_port_instead_of_hanging(tmp_path):
    (tmp_path / "train.py").write_text(POST_002)
    proc = multigpu("run", "--devices", "cpu:2", "train.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "multigpu: error: train.py:7: sets MASTER_PORT='29500': multigpu run hosts the rendezvous "
        "on a port of its own, so every rank would wait there for a store nobody hosts (a hang); "
        "delete the line, or launch with --master-port 29500"]


def test_a_module_is_read_like_a_script_and_a_missing_resume_fails_as_train_says(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(POST_002)
    proc = multigpu("doctor", "--devices", "cpu:2", "--", "-m", "mypkg.train", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert any(line.startswith("fail  launch env") and "train.py:7" in line for line in proc.stdout.splitlines())
    resume = multigpu("doctor", "--model", "mlp", "--devices", "cpu:1", "--resume", "nope", cwd=tmp_path)
    assert resume.returncode == 1
    [line] = [line for line in resume.stdout.splitlines() if line.startswith("fail")]
    assert line.startswith("fail  options") and "nope" in line


def checks(stdout: str) -> dict[str, str]:
    """check name -> its line (the last one of that name), from the columns doctor prints."""
    return {line[6:20].strip(): line for line in stdout.splitlines()
            if line[:4].strip() in ("ok", "warn", "fail")}


DDP_SCRIPT = """\
import os
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.body = nn.Linear(4, 2)

    def forward(self, x):
        return self.body(self.head(x))


dist.init_process_group("gloo")
open(f"started-{dist.get_rank()}.txt", "w").write(str(os.getpid()))
ds = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
sampler = DistributedSampler(ds)
loader = DataLoader(ds, batch_size=4, sampler=sampler)
model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
open("finished.txt", "w").write("done")
dist.destroy_process_group()
"""


def doctor_script(tmp_path, source: str, *args):
    """`multigpu doctor --devices cpu:2 ARGS -- train.py` on `source`, with a TMPDIR of its own."""
    (tmp_path / "train.py").write_text(source)
    (tmp_path / "tmp").mkdir()
    return run_with({"TMPDIR": str(tmp_path / "tmp")}, "doctor", "--devices", "cpu:2", *args,
                    "--", "train.py", cwd=tmp_path)


def test_a_script_is_run_up_to_its_steps_on_two_ranks_then_stopped_with_nothing_left(tmp_path):
    import psutil

    proc = doctor_script(tmp_path, DDP_SCRIPT, "--steps", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = checks(proc.stdout)
    assert found["script run"].startswith("ok    script run     ran on 2 ranks up to optimizer step 3 (")
    assert found["script run"].endswith(" s), then stopped it: nothing after that step ran")
    assert found["unused params"] == ("ok    unused params  every trainable parameter of the optimizer "
                                      "got a gradient in its first step (trap 6)")
    assert found["sampler"] == ("ok    sampler        train.py:28: the DataLoader is sharded "
                                "(DistributedSampler): 8 batches per rank")
    assert found["batch"] == ("ok    batch          4 samples per rank in the model's first forward; "
                              "8 over the 2 ranks")
    assert found["side effects"] == (f"ok    side effects   files the script wrote under {tmp_path} before it "
                             "was stopped (new: started-0.txt, started-1.txt) are left as they are")
    *_, summary, estimate = proc.stdout.splitlines()
    assert summary == "9 checks: 0 failed, 0 warnings"
    # steps 2 and 3 timed (the first is the start-up's), the epoch from the loader's 8 batches
    said = re.fullmatch(r"estimate   ~(.+) an epoch of 8 steps \(training (.+)\) \(from 2 measured "
                        r"steps, ±\d+ %\); not in it: start-up, the first step, evaluation and "
                        r"checkpoints \(the script's own\)", estimate)
    assert said and seconds_of(said.group(1)) == seconds_of(said.group(2)), estimate
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "finished.txt").exists(), "the script ran past its third step"
    pids = [int((tmp_path / f"started-{r}.txt").read_text()) for r in (0, 1)]
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE], "a rank is still running"
    assert not list((tmp_path / "tmp").glob("multigpu-doctor-*")), "the trial folder was left behind"
    assert not (tmp_path / "runs").exists()


def test_scaling_runs_the_script_again_on_one_device_and_says_the_speed_up_of_two(tmp_path):
    proc = doctor_script(tmp_path, DDP_SCRIPT, "--steps", "4", "--scaling")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    *_, summary, estimate, scaling = proc.stdout.splitlines()
    assert summary == "9 checks: 0 failed, 0 warnings" and estimate.startswith("estimate   ~")
    said = re.fullmatch(r"scaling    ([\d.]+)x on 2 devices \((\d+) % of 2x one device\); measured: 1 "
                        r"device ([\d.]+) ms a step, 2 devices ([\d.]+) ms, 4 samples each, the "
                        r"script's own steps from the second on, on rank 0's clock; 2 CPU processes "
                        r"share this host's \d+ cores \(and its other work\): a noise-prone figure, "
                        r"not a GPU's", scaling)
    assert said, scaling
    x, share, one, two = map(float, said.groups())
    assert x == pytest.approx(2 * one / two, rel=0.01, abs=0.01) and share == pytest.approx(50 * x, abs=1)
    assert not (tmp_path / "finished.txt").exists(), "a trial ran past its fourth step"
    assert not list((tmp_path / "tmp").glob("multigpu-doctor-*")), "a trial folder was left behind"


def test_a_module_unused_in_forward_is_named_from_the_first_step_and_fails(tmp_path):
    proc = doctor_script(tmp_path, DDP_SCRIPT.replace("self.body(self.head(x))", "self.body(x)"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert checks(proc.stdout)["unused params"] == (
        "fail  unused params  2 parameter(s) got no gradient in the first step: head.weight, "
        "head.bias (module head); DDP stops at the next forward: remove the unused module, freeze "
        "it (requires_grad_(False)), or DistributedDataParallel(model, find_unused_parameters=True) "
        "(slower) (trap 6)")
    assert "Traceback" not in proc.stderr and not (tmp_path / "finished.txt").exists()


def test_a_training_loader_without_a_distributed_sampler_is_named(tmp_path):
    source = (DDP_SCRIPT.replace("sampler = DistributedSampler(ds)\n", "")
              .replace("sampler=sampler)", "shuffle=True)").replace("    sampler.set_epoch(epoch)\n", ""))
    proc = doctor_script(tmp_path, source)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert checks(proc.stdout)["sampler"] == (
        "warn  sampler        train.py:26: the DataLoader has no DistributedSampler (RandomSampler): "
        "each of the 2 ranks goes through all 64 samples (16 batches), repeating the others' work; "
        "fix: DataLoader(ds, sampler=DistributedSampler(ds)) and sampler.set_epoch(epoch) each "
        "epoch, or multigpu's rt.prepare(loader)")


def test_a_library_script_refused_at_its_first_backward_is_a_failed_run(tmp_path):
    from .test_library_scripts import SCRIPTS

    proc = doctor_script(tmp_path, (SCRIPTS / "unused_parameter.py").read_text())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = checks(proc.stdout)
    assert found["script run"] == (
        "fail  script run     train.py:34: ranks 0, 1 failed before optimizer step 1: 2 parameter(s) "
        "got no gradient in the first backward: initial.weight, initial.bias. DDP needs every "
        "trainable parameter to take part in the loss: remove the unused module, freeze it "
        "(requires_grad_(False)), or pass setup(ddp=DDPOptions(find_unused_parameters=True))")
    assert "unused params" not in found, "no step ran to judge it"
    assert found["sampler"].startswith("ok    sampler        train.py:30: the DataLoader is sharded "
                                       "(ShardedBatchSampler)")


MANUAL_SGD = """\
import os
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
open(f"started-{dist.get_rank()}.txt", "w").write(str(os.getpid()))
model = nn.Linear(4, 2)
x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
for step in range(10**9):  # about forever: only the trial's time limit stops it
    loss = nn.functional.cross_entropy(model(x), y)
    model.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.data -= 0.01 * p.grad
open("finished.txt", "w").write("done")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("devices", ["cpu:2", "cpu:1"])
def test_a_script_without_a_torch_optim_step_is_stopped_at_the_trial_timeout(tmp_path, devices):
    import psutil

    (tmp_path / "train.py").write_text(MANUAL_SGD)
    (tmp_path / "tmp").mkdir()
    began = time.monotonic()
    proc = run_with({"TMPDIR": str(tmp_path / "tmp")}, "doctor", "--devices", devices,
                    "--trial-timeout", "5", "--", "train.py", cwd=tmp_path)
    took = time.monotonic() - began
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = checks(proc.stdout)["script run"]
    at = re.match(r"warn  script run     train\.py:(\d+): no rank reached optimizer step 1 within "
                  r"--trial-timeout 5 s; doctor stopped every rank there: likely causes: ", line)
    assert at and 11 <= int(at.group(1)) <= 16, line  # where rank 0 was: in its loop
    assert line.endswith("the script updates its weights without a torch.optim optimizer (e.g. "
                         "p.data -= lr * p.grad) or only evaluates, and doctor can only watch "
                         "torch.optim steps; or its first step is slow (data loading, a download, "
                         "compilation): raise --trial-timeout"), line
    assert "unused params" not in checks(proc.stdout), "no step ran to judge it"
    assert took < 5 + 90, f"doctor took {took:.0f} s"  # the start-up of two ranks on a loaded CPU
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "finished.txt").exists(), "the script ran to its end"
    ranks = 2 if devices == "cpu:2" else 1
    pids = [int((tmp_path / f"started-{r}.txt").read_text()) for r in range(ranks)]
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE], "a rank is still running"
    assert not list((tmp_path / "tmp").glob("multigpu-doctor-*")), "the trial folder was left behind"


@pytest.mark.extended  # the backstop behind the trial's own timer (tested above); CI runs it
def test_a_rank_that_cannot_stop_itself_at_the_trial_timeout_is_killed(tmp_path):
    """A regular expression that backtracks holds the interpreter: the rank's own timer thread
    never runs, so the doctor kills it a grace period after the limit."""
    import psutil

    (tmp_path / "train.py").write_text(
        "import os, re\n"
        "open('started-0.txt', 'w').write(str(os.getpid()))\n"
        "re.match(r'(a+)+$', 'a' * 40 + 'b')  # hours, with no other thread let in\n"
        "open('finished.txt', 'w').write('done')\n")
    (tmp_path / "tmp").mkdir()
    began = time.monotonic()
    proc = run_with({"TMPDIR": str(tmp_path / "tmp")}, "doctor", "--devices", "cpu:1",
                    "--trial-timeout", "2", "--", "train.py", cwd=tmp_path)
    took = time.monotonic() - began
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert checks(proc.stdout)["script run"] == (
        "warn  script run     no rank reached optimizer step 1 within --trial-timeout 2 s; doctor "
        "killed every rank: a rank could not stop itself: it was in a call that lets no other "
        "thread run (a C extension, a regular expression backtracking); its logs are named above")
    assert took < 2 + 15 + 60, f"doctor took {took:.0f} s"  # the limit, the grace, the start-up
    assert not (tmp_path / "finished.txt").exists()
    pid = int((tmp_path / "started-0.txt").read_text())
    assert not (psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
