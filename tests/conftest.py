"""Shared fixtures: every test leaves the environment, torch.distributed and the console (who
prints, in whose words: a `multigpu train` run in the test's process sets both) as it found them."""
import os

import pytest


@pytest.fixture(autouse=True)
def _restore_environment():
    from multigpu.core import console

    saved, printing = dict(os.environ), (console._enabled, console._say)
    yield
    os.environ.clear()
    os.environ.update(saved)
    console._enabled, console._say = printing
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
