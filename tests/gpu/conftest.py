"""GPU tier: every process these tests start runs under our GPU machines' rule (NVLink SHARP /
multicast off, tests.multiproc.conftest.GPU_MACHINE_ENV), which multigpu itself does not impose."""
import os

import pytest

from tests.multiproc.conftest import GPU_MACHINE_ENV, _no_process_left_behind  # noqa: F401 (autouse here too)


def gpu_env() -> dict:
    """The environment for a command a GPU test starts: ours, with the machine's rule, and without
    CUDA_VISIBLE_DEVICES (the test chooses GPUs through --devices)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
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
