"""--min-devices and --device-health without launching: the health command's output read, the
command itself run for real (its output, its failure, its timeout), the decision where the next
attempt runs, the global batch on fewer devices, the flags' one-line refusals, the closing
recovery figures from the attempts' step records."""
from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

import pytest

from multigpu.core.errors import UsageError
from multigpu.launcher import launch
from multigpu.launcher.health import lost_devices
from multigpu.launcher.health.device_health import Device, DeviceHealth, from_errors, parse_named, run_command
from multigpu.launcher.devices import DevicePlan
from multigpu.launcher.rank import step_record
from multigpu.train import global_batch
from multigpu.train.settings.config import config_from_args

CPU3 = tuple(Device(f"cpu:{i}") for i in range(3))
GPUS = (Device("cuda:0", "4"), Device("cuda:1", "GPU-8f2a"), Device("cuda:3", "6"))


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launch.add_launch_arguments(p)
    return p.parse_args(list(argv))


# ------------------------------------------------------------------------- the command's output

@pytest.mark.parametrize("text, named", [
    ("cpu:1\n", ["cpu:1"]), ("1", ["cpu:1"]), ("2, 0\n", ["cpu:0", "cpu:2"]),
    ("# all checked\n\n", []), ("", []), ("cpu:1 cpu:1\ncpu:2", ["cpu:1", "cpu:2"]),
    ("CPU:1", ["cpu:1"])])
def test_the_health_output_names_devices_by_name_or_index_one_per_line_or_with_commas(text, named):
    found, unknown = parse_named(text, CPU3)
    assert [d.name for d in found] == named and unknown == []


def test_gpus_are_named_by_their_ids_or_uuids_not_by_the_visible_devices_index():
    found, unknown = parse_named("cuda:0\nGPU-8f2a\n6\n", GPUS)
    # 6 is GPU cuda:3's physical index under the user's CUDA_VISIBLE_DEVICES: ids are what
    # --devices takes, so 6 names no device of the run
    assert [d.name for d in found] == ["cuda:0", "cuda:1"] and unknown == ["6"]


def test_a_gpu_is_named_by_its_nvml_uuid_without_a_cuda_visible_devices_of_uuids():
    """nvidia-smi's UUID names the GPU when the ranks' CUDA_VISIBLE_DEVICES holds plain indexes
    (on one H200, 2026-12-02, it was 'not a device of this run (cuda:0); ignored')."""
    plan = DevicePlan("cuda", (0, 1), 2, tokens=("0", "1"),
                      uuids=("GPU-d76f3bb9-801b-fb60-ecb7-7898a32a728f", "GPU-11aa"))
    found, unknown = parse_named("GPU-D76F3BB9-801b-fb60-ecb7-7898a32a728f\n", lost_devices.devices_of(plan))
    assert [d.name for d in found] == ["cuda:0"] and unknown == []


def test_a_word_that_names_no_device_is_said_and_ignored():
    warned = []
    found = run_command("echo cpu:7, cpu:1", CPU3, warned.append)
    assert [d.name for d in found] == ["cpu:1"]
    assert warned == ["--device-health echo cpu:7, cpu:1 named cpu:7: not a device of this run "
                      "(cpu:0, cpu:1, cpu:2); ignored"]


def test_the_command_is_told_the_devices_of_the_attempt(tmp_path):
    script = tmp_path / "h.sh"
    script.write_text('#!/bin/sh\necho "$MULTIGPU_DEVICES" | cut -d, -f3\n')
    script.chmod(0o755)
    assert run_command(str(script), CPU3, pytest.fail) == [CPU3[2]]


def test_a_command_that_fails_or_hangs_warns_once_and_names_no_device():
    warned = []
    assert run_command("echo cpu:1; echo 'no such GPU tool' >&2; exit 3", CPU3, warned.append) == []
    began = time.monotonic()
    assert run_command("sleep 5; echo cpu:1", CPU3, warned.append, timeout=0.5) == []
    assert time.monotonic() - began < 4
    assert warned == ["--device-health echo cpu:1; echo 'no such GPU tool' >&2; exit 3: exit code 3 "
                      "(no such GPU tool); taken as naming no device",
                      "--device-health sleep 5; echo cpu:1: no answer in 0.5 s; taken as naming no device"]


def test_a_ranks_cuda_hardware_error_names_its_device_and_a_programs_error_does_not():
    def failure(text):
        return SimpleNamespace(error_file_data={"message": text})
    found = from_errors({1: failure("RuntimeError: CUDA error: uncorrectable ECC error encountered"),
                         0: failure("RuntimeError: CUDA error: an illegal memory access was encountered"),
                         2: failure("ValueError: bad label 12")}, GPUS)
    assert [(u.device.name, u.why) for u in found] == [
        ("cuda:1", "its rank's CUDA error: uncorrectable ECC error")]


# ------------------------------------------------------------------------- where the next attempt runs

def _policy(command: str, min_devices: int, reshape=None) -> lost_devices.LostDevices:
    return lost_devices.LostDevices(min_devices, DeviceHealth(command, CPU3, pytest.fail), reshape)


def test_a_named_device_is_dropped_while_min_devices_are_left():
    nxt = lost_devices.next_attempt(_policy("echo cpu:1", 2, lambda n: (["again", str(n)], "; G")),
                                    CPU3, {})
    assert nxt.devices == (CPU3[0], CPU3[2]) and nxt.dropped == (CPU3[1],)
    assert nxt.cmd == ["again", "2"] and nxt.extra == "; G"
    assert nxt.on == ("cpu:1 is unhealthy (--device-health echo cpu:1): dropped; restarting on the 2 "
                      "healthy devices (cpu:0, cpu:2) from the newest checkpoint")


def test_no_device_named_is_the_same_devices_and_too_few_left_is_a_stop():
    same = lost_devices.next_attempt(_policy("true", 2), CPU3, {})
    assert same.devices == CPU3 and same.cmd is None and same.on == ""
    stop = lost_devices.next_attempt(_policy("echo 0 2", 2), CPU3, {})
    assert stop.line == ("cpu:0, cpu:2 are unhealthy (--device-health echo 0 2): 1 healthy device "
                         "left (cpu:1), fewer than --min-devices 2; not restarted")


def test_a_gpu_plan_gives_each_rank_its_gpu_and_one_process_of_many_gpus_none():
    plan = DevicePlan("cuda", (0, 1), 2, tokens=("2", "3"))
    assert lost_devices.devices_of(plan) == (Device("cuda:0", "2"), Device("cuda:1", "3"))
    assert lost_devices.devices_of(DevicePlan("cuda", (0, 1), 1)) == ()


def _cfg(*argv):
    from multigpu.train.settings.config import add_config_arguments

    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return config_from_args(p.parse_args(["--model", "mlp", "--data", "digits", *argv]))


def test_the_global_batch_is_kept_where_the_devices_left_can_make_it_else_the_nearest():
    reshape = global_batch.on_fewer_devices(_cfg("--global-batch-size", "24", "--batch-size", "4"),
                                            lambda cfg: ["G", str(cfg.optim.global_batch_size)])
    assert reshape(2) == (None, "; --global-batch-size 24 kept: 4 per device x 2 devices x 3 micro-batches")
    # 24 on 5 devices: not even; 20 (4 per device) below, 30 (6 = 3 x 2) above: 20 is nearer
    assert reshape(5) == (["G", "20"], "; --global-batch-size 24 cannot be made on 5 devices: 20 "
                                       "instead (4 per device x 5 devices x 1 micro-batch)")
    # 24 on 7 devices: 21 (3 per device) below, 28 (4) above: 21 is nearer
    assert reshape(7)[0] == ["G", "21"]
    assert global_batch.on_fewer_devices(_cfg(), lambda cfg: []) is None


# ------------------------------------------------------------------------- the flags

@pytest.mark.parametrize("argv, line", [
    (("--min-devices", "0", "--max-restarts", "1"),
     "--min-devices 0: give 1 or more, the fewest devices the run may go on with, e.g. --min-devices 2"),
    (("--min-devices", "2"),
     "--min-devices 2 drops a lost device when the run restarts: give --max-restarts N too, e.g. "
     "--max-restarts 2"),
    (("--device-health", "./h.sh", "--max-restarts", "1"),
     "--device-health ./h.sh is asked when a rank dies, to drop a lost device: give --min-devices M "
     "too (with --max-restarts N)")])
def test_bad_lost_device_flags_are_one_line_with_the_fix(argv, line, monkeypatch):
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    with pytest.raises(UsageError) as err:
        launch.options_from_args(parse(*argv))
    assert str(err.value) == line


def test_min_devices_is_checked_against_the_devices_and_the_machines():
    opts = launch.LaunchOptions(max_restarts=1, min_devices=3)
    with pytest.raises(UsageError, match=r"^--min-devices 3: the run has 2 devices; give "
                                         r"--min-devices 2 or fewer$"):
        launch.check_min_devices(opts, DevicePlan("cpu", (), 2))
    opts.nnodes = "2"
    with pytest.raises(UsageError, match="works on one machine; several nodes restart on the same devices"):
        launch.check_min_devices(opts, DevicePlan("cpu", (), 4))
    launch.check_min_devices(launch.LaunchOptions(max_restarts=1, min_devices=2), DevicePlan("cpu", (), 2))


# ------------------------------------------------------------------------- the closing figures

def test_recovery_is_the_failure_to_the_next_first_step_and_the_samples_past_the_resume(tmp_path):
    began = time.time()
    first = step_record.StepRecord(step_record.path_of(tmp_path, 0), 0)
    for samples in range(24, 24 * 8, 24):  # 7 steps of 24: 168 samples
        first.stepped(samples)
    failed_at = time.time()
    second = step_record.StepRecord(step_record.path_of(tmp_path, 1), 120)  # resumed at step 5
    second.stepped(144)
    restart = lost_devices.Restart(1, failed_at, ("cpu:1",), 2)
    (rec,) = lost_devices.recoveries(str(tmp_path), [restart], began)
    assert (rec.twice, rec.samples) == (2, 48) and 0 <= rec.seconds < 5
    assert lost_devices.recovery_line(rec) == (
        f"recovery: restart 1 (cpu:1 dropped: on 2 devices): {rec.seconds:.1f} s from the failure to "
        "the first resumed step; 2 steps trained twice (48 samples trained before the failure past "
        "the checkpoint resumed from)")
    # records of an earlier launch in the same folder are not this one's: no figures
    assert lost_devices.recoveries(str(tmp_path), [restart], time.time() + 1) == []
    second.close()
    step_record.path_of(tmp_path, 0).unlink()  # the failed attempt recorded nothing
    (late,) = lost_devices.recoveries(str(tmp_path), [restart], began)
    assert (late.twice, late.samples) == (None, None)
    assert lost_devices.recovery_line(late).endswith("s from the failure to the first resumed step")
