"""The GPU twin of tests/multiproc/test_startup_kills.py: a launcher on 2 GPUs killed during
start-up takes its workers with it (they held the GPUs, and trained on alone), and the same
command then runs in the same folder."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import gpu_env
from tests.multiproc.test_startup_kills import (MOMENTS, Launch, assert_same_command_trains,
                                                assert_workers_end, held_at, kill_9,
                                                start_held_in_process_group_setup)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.parametrize("moment", [*MOMENTS, "process group"])
def test_kill_9_of_the_launcher_on_gpus_during_start_up_ends_its_workers(tmp_path, moment):
    out = tmp_path / "run"
    if moment == "process group":  # rank 1 held before its process group (as on CPU)
        run, workers = start_held_in_process_group_setup(tmp_path, out, "2", gpu_env())
    else:
        hold, wait = MOMENTS[moment]
        env, markers = held_at(tmp_path, gpu_env(), **hold) if hold else (gpu_env(), None)
        run = Launch(out, devices="2", env=env)
        wait(run, markers)
        workers = run.workers(count=0)() or []
    kill_9(run)
    assert_workers_end(out, workers)
    said = assert_same_command_trains(out, devices="2", env=gpu_env())
    assert "already exists" not in said and "GPUs are free" not in said
