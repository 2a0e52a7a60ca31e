"""GPU tier: every process these tests start runs under our GPU machines' rule (NVLink SHARP /
multicast off, tests.multiproc.conftest.GPU_MACHINE_ENV), which multigpu itself does not impose."""
import os

import pytest

from tests.multiproc.conftest import GPU_MACHINE_ENV, _no_process_left_behind  # noqa: F401 (autouse here too)


# This session's GPUs, for two sessions side by side on one 4-GPU machine
# (MULTIGPU_TEST_GPUS=0,1 and =2,3): the commands the tests start see only these.
TEST_GPUS_ENV = "MULTIGPU_TEST_GPUS"


def gpu_env() -> dict:
    """The environment for a command a GPU test starts: ours, with the machine's rule, and without
    a CUDA_VISIBLE_DEVICES of the caller's (the test chooses GPUs through --devices), unless
    $MULTIGPU_TEST_GPUS gives this session its GPUs."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if os.environ.get(TEST_GPUS_ENV):
        env["CUDA_VISIBLE_DEVICES"] = os.environ[TEST_GPUS_ENV]
    return env | GPU_MACHINE_ENV


@pytest.fixture(autouse=True)
def _gpu_machine_env(monkeypatch):
    """For what runs in the test's own process, and the processes it spawns without an env."""
    for key, value in GPU_MACHINE_ENV.items():
        monkeypatch.setenv(key, value)


def pytest_collection_modifyitems(config, items):
    """Tests that start CUDA in pytest's own process (marker cuda_here) run after all the others:
    from then on that process holds GPU 0, and a later run's `--devices 2` would find it busy."""
    items.sort(key=lambda item: item.get_closest_marker("cuda_here") is not None)  # a stable sort
