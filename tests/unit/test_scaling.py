"""doctor --scaling's arithmetic and its line (doctor/scaling.py)."""
import pytest

from multigpu.doctor.scaling import scaling_line, speedup
from multigpu.train.checkpoints.pause import checkpoint_pause
from multigpu.train.run_estimate import checkpoints_an_epoch
from multigpu.train.control import Cadence


def test_the_speed_up_is_n_batches_in_one_step_of_n_devices_against_one_in_one_device_s_step():
    x, eff = speedup(0.040, 0.043, 2)  # 2 batches in 43 ms against 1 in 40 ms
    assert x == pytest.approx(2 * 40 / 43) and eff == pytest.approx(40 / 43)
    assert speedup(0.1, 0.1, 4) == (4.0, 1.0)  # linear: N devices' step as fast as one's
    x, eff = speedup(0.1, 0.5, 4)  # each step 5x slower on 4: slower than one device
    assert x == pytest.approx(0.8) and eff == pytest.approx(0.2)


def test_the_line_says_the_speed_up_its_share_of_linear_and_what_was_measured():
    assert scaling_line(0.0401, 0.0431, 2, batch=32, cpu=False) == (
        "1.86x on 2 devices (93 % of 2x one device); measured: 1 device 40.1 ms a step, 2 devices "
        "43.1 ms, 32 samples each, synthetic data (multigpu bench)")
    assert scaling_line(1.5, 3.0, 4, batch=8, cpu=False).startswith(
        "2.00x on 4 devices (50 % of 4x one device); measured: 1 device 1500 ms a step, 4 devices 3000 ms")


def test_on_cpu_processes_the_line_says_they_share_the_host_s_cores():
    said = scaling_line(0.02, 0.025, 2, batch=32, cpu=True, cores=2)
    assert said.endswith("; 2 CPU processes share this host's 2 cores (and its other work): a "
                         "noise-prone figure, not a GPU's")


def test_an_epoch_holds_its_end_s_checkpoint_and_those_checkpoint_every_adds():
    assert checkpoints_an_epoch(Cadence(), 100, 30.0) == 1
    assert checkpoints_an_epoch(Cadence(steps=25), 100, 30.0) == 4  # after steps 25, 50, 75, and the end
    assert checkpoints_an_epoch(Cadence(steps=500), 100, 30.0) == 1
    assert checkpoints_an_epoch(Cadence(seconds=10.0), 100, 35.0) == 4


def test_a_checkpoint_s_pause_is_timed_on_one_rank_and_not_while_the_last_write_runs():
    import threading

    import torch

    from multigpu.core.runtime import setup
    from multigpu.train.checkpoints.checkpoint_writer import BackgroundWriter

    rt = setup("single", "fp32", accelerator="cpu")
    model = torch.nn.Linear(256, 256)
    job = type("Job", (), {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
                           "scheduler": None})()
    assert 0 < checkpoint_pause(rt, job) < 5
    writer, release = BackgroundWriter(), threading.Event()
    try:
        writer.save({"w": torch.zeros(2)}, lambda state: release.wait(10))
        assert checkpoint_pause(rt, job, writer) is None  # its buffers are being written
        release.set()
        writer.wait()
        assert checkpoint_pause(rt, job, writer) > 0
    finally:
        release.set()
        writer.close()
