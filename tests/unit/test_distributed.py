"""How a process leaves its process group: gloo ranks meet first, unless this one failed."""
import pytest

from multigpu import distributed


class FakeDist:
    def __init__(self, backend="gloo", world_size=2, barrier_error=None):
        self.calls = []
        self.backend, self.world_size, self.barrier_error = backend, world_size, barrier_error

    def is_available(self):
        return True

    def is_initialized(self):
        return "destroy" not in self.calls

    def get_backend(self):
        return self.backend

    def get_world_size(self):
        return self.world_size

    def monitored_barrier(self, timeout):
        self.calls.append(("barrier", timeout.total_seconds()))
        if self.barrier_error:
            raise self.barrier_error

    def destroy_process_group(self):
        self.calls.append("destroy")


@pytest.fixture
def fake(monkeypatch):
    def make(**kwargs):
        d = FakeDist(**kwargs)
        monkeypatch.setattr(distributed, "dist", d)
        monkeypatch.setattr(distributed, "_failed", False)
        return d
    return make


def test_a_clean_exit_meets_the_other_gloo_ranks_then_destroys(fake):
    d = fake()
    distributed._destroy_at_exit()
    assert d.calls == [("barrier", distributed._EXIT_BARRIER_SECONDS), "destroy"]
    distributed._destroy_at_exit()  # already gone: nothing more
    assert d.calls == [("barrier", distributed._EXIT_BARRIER_SECONDS), "destroy"]


def test_a_failed_rank_does_not_wait_for_the_others(fake):
    d = fake()
    distributed.mark_failed()
    distributed._destroy_at_exit()
    assert d.calls == ["destroy"]


def test_a_peer_that_is_gone_does_not_stop_the_teardown(fake):
    d = fake(barrier_error=RuntimeError("rank 1 did not reach monitoredBarrier"))
    distributed._destroy_at_exit()
    assert d.calls[-1] == "destroy"


@pytest.mark.parametrize("backend,world", [("nccl", 2), ("gloo", 1)])
def test_only_gloo_groups_of_several_ranks_wait(fake, backend, world):
    d = fake(backend=backend, world_size=world)
    distributed._destroy_at_exit()
    assert d.calls == ["destroy"]


def test_a_usage_error_in_the_cli_marks_the_process_failed(fake, capsys):
    from multigpu.cli import main

    fake()
    assert main(["train", "--model", "no-such-model"]) == 2
    assert distributed._failed is True
    assert "no-such-model" in capsys.readouterr().err
