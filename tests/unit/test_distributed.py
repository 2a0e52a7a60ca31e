"""How a process leaves its process group: gloo ranks meet first (never waiting for ever), unless
this one failed."""
import datetime
import threading
import time
from types import SimpleNamespace

import pytest
import torch.distributed as torch_dist

from multigpu.core import distributed
from multigpu.core.errors import UsageError


class FakeDist:
    """The torch.distributed calls destroy_distributed makes, recorded."""

    def __init__(self, backend="gloo", world_size=2):
        self.calls = []
        self.backend, self.world_size = backend, world_size
        self.group = SimpleNamespace(WORLD=object())

    def is_available(self):
        return True

    def is_initialized(self):
        return "destroy" not in self.calls

    def get_backend(self):
        return self.backend

    def get_world_size(self):
        return self.world_size

    def destroy_process_group(self):
        self.calls.append("destroy")


@pytest.fixture
def fake(monkeypatch):
    def make(**kwargs):
        d = FakeDist(**kwargs)
        monkeypatch.setattr(distributed, "dist", d)
        monkeypatch.setattr(distributed, "_failed", False)
        monkeypatch.setattr(distributed, "_meet_before_teardown",
                            lambda world, *store: d.calls.append(("meet", world)))
        return d
    return make


def test_a_clean_exit_meets_the_other_gloo_ranks_then_destroys(fake):
    d = fake()
    distributed._destroy_at_exit()
    assert d.calls == [("meet", 2), "destroy"]
    distributed._destroy_at_exit()  # already gone: nothing more
    assert d.calls == [("meet", 2), "destroy"]


def test_a_failed_rank_does_not_wait_for_the_others(fake):
    d = fake()
    distributed.mark_failed()
    distributed._destroy_at_exit()
    assert d.calls == ["destroy"]


@pytest.mark.parametrize("backend,world", [("nccl", 2), ("gloo", 1)])
def test_only_gloo_groups_of_several_ranks_wait(fake, backend, world):
    d = fake(backend=backend, world_size=world)
    distributed._destroy_at_exit()
    assert d.calls == ["destroy"]


@pytest.mark.parametrize("argv,code", [(["train", "--model", "no-such-model"], 2)])
def test_a_usage_error_in_the_cli_marks_the_process_failed(fake, capsys, argv, code):
    from multigpu.cli import main

    fake()
    assert main(argv) == code
    assert distributed._failed is True
    assert "no-such-model" in capsys.readouterr().err


def test_a_worker_leaves_its_failure_in_the_launcher_s_error_file(fake, capsys, monkeypatch, tmp_path):
    """Under the launcher (TORCHELASTIC_ERROR_FILE), what the report reads for a rank whose own
    output went to the console: the one line of bad input, or the traceback of a crash."""
    import json

    from multigpu import cli
    from multigpu.cli import train

    fake()
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    assert cli.main(["train", "--model", "no-such-model"]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith("multigpu: error: ") and json.loads(path.read_text())["message"] == said
    monkeypatch.setenv("MULTIGPU_DEBUG", "")  # --debug sets it: undone after the test
    with pytest.raises(UsageError):  # --debug: the traceback, as on the console
        cli.main(["--debug", "train", "--model", "no-such-model"])
    message = json.loads(path.read_text())["message"]
    assert message.startswith("Traceback (most recent call last):") and "no-such-model" in message

    def crash(args):
        raise ValueError("boom")

    monkeypatch.setattr(train, "main", crash)
    with pytest.raises(ValueError):
        cli.main(["train", "--model", "mlp"])
    message = json.loads(path.read_text())["message"]
    assert message.startswith("Traceback (most recent call last):") and message.endswith("ValueError: boom")


def test_an_echo_under_multigpu_s_launcher_is_left_to_its_report(fake, capsys, monkeypatch, tmp_path):
    """A lost peer under multigpu's launcher: the traceback goes to the error file only, exit 1,
    and the process is marked failed (else a gloo rank waits 30 s at exit for peers that are
    gone, and the agent's SIGKILL makes it look like the culprit). With MULTIGPU_DEBUG (--debug),
    without the launcher's report, or where no error file could be written: raised, as before."""
    import json

    from multigpu import cli
    from multigpu.cli import train

    def lost_peer(args):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")

    monkeypatch.setattr(train, "main", lost_peer)
    monkeypatch.delenv("MULTIGPU_DEBUG", raising=False)
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    for reports, debug in (("", ""), ("1", "1")):
        fake()
        monkeypatch.setenv("MULTIGPU_LAUNCHER_REPORTS", reports)
        monkeypatch.setenv("MULTIGPU_DEBUG", debug)
        with pytest.raises(RuntimeError, match="Connection closed"):
            cli.main(["train", "--model", "mlp"])
    monkeypatch.delenv("MULTIGPU_DEBUG")
    fake()
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "a-file" / "error.json"))
    with pytest.raises(RuntimeError, match="Connection closed"):  # nowhere else to keep it
        cli.main(["train", "--model", "mlp"])
    fake()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    capsys.readouterr()
    assert cli.main(["train", "--model", "mlp"]) == 1
    assert capsys.readouterr().err == "" and distributed._failed is True
    assert json.loads(path.read_text())["message"].endswith("Connection closed by peer [127.0.0.1]:1")


@pytest.fixture
def store(monkeypatch):
    """A real key-value store, where the launcher's would be (MASTER_ADDR / MASTER_PORT)."""
    server = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{time.monotonic_ns()}")
    return server


def _meet_in_threads(n: int, world: int) -> list[float]:
    """n ranks (threads) of a world of `world` meet; the seconds each one waited."""
    waited = [None] * n

    def rank(i):
        start = time.monotonic()
        distributed._meet_before_teardown(world)
        waited[i] = time.monotonic() - start

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a rank kept waiting past the exit timeout"
    return waited


def test_ranks_meet_through_the_store_and_go_on_together(store):
    waited = _meet_in_threads(3, 3)
    assert all(w < distributed._EXIT_WAIT_SECONDS for w in waited)
    assert store.get(f"multigpu/exit/{distributed.os.environ['TORCHELASTIC_RUN_ID']}/0/all") == b"1"


def test_a_rank_that_never_comes_costs_the_others_the_timeout_not_more(store, monkeypatch):
    monkeypatch.setattr(distributed, "_EXIT_WAIT_SECONDS", 1)
    waited = _meet_in_threads(1, 2)  # its peer never arrives
    assert 0.9 < waited[0] < 10


def test_the_worker_tears_down_a_group_the_script_left_alive(tmp_path):
    from multigpu.launcher.rank import worker

    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    worker._finish_group({"clean": True}, None, None)
    assert not torch_dist.is_initialized()
    worker._finish_group({"clean": True}, None, None)  # nothing left: nothing happens
