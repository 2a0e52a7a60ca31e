"""Run folders: claimed without races, never someone else's, metrics consistent after a resume."""
import json
import os
import threading

import pytest

from multigpu.train.rundir import folder_users, runfolder
from multigpu.core.errors import UsageError


def _race(n, work):
    barrier, results = threading.Barrier(n), [None] * n

    def one(i):
        barrier.wait()
        try:
            results[i] = work()
        except UsageError as exc:
            results[i] = exc
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("model, data, name", [
    ("mlp", "digits", "mlp-digits"), ("resnet18", "folder:/data/imgs", "resnet18-folder"),
    ("mlp", "./imgs", "mlp-imgs"), ("mlp", "/no/such/", "mlp-no-such"), ("mlp", ".", "mlp-data"),
    ("mlp", "..", "mlp-data"), ("timm:org/vit", "synthetic:100", "timm-org-vit-synthetic"),
    ("mlp", "a\\b c", "mlp-a-b-c"),
])
def test_a_default_run_folder_is_one_safe_name_under_runs(monkeypatch, model, data, name):
    monkeypatch.setattr(runfolder.time, "strftime", lambda fmt: "20261123-120000")
    out = runfolder.default_out(model, data)
    assert out.parent.name == "runs" and out.name == f"20261123-120000-{name}"


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runfolder.time, "strftime", lambda fmt: "20261123-120000")
    folders = _race(6, lambda: runfolder.reserve(None, model="mlp", data="digits", continuing=False))
    assert len({str(f) for f in folders}) == 6
    assert sorted(f.name for f in folders)[:2] == ["20261123-120000-mlp-digits",
                                                   "20261123-120000-mlp-digits-2"]
    assert all(runfolder.nothing_trained(f) for f in folders)


def test_two_runs_racing_for_one_out_folder_one_wins(tmp_path):
    out = tmp_path / "run"
    results = _race(4, lambda: runfolder.reserve(str(out), model="m", data="d", continuing=False))
    assert sum(not isinstance(r, UsageError) for r in results) == 1
    # the winner (this process) holds it while it runs: the others are told so, not to --resume
    assert all(str(r) == f"--out {out} is used by a run starting or running now (pid {os.getpid()}); "
               "choose another --out, or stop that run first"
               for r in results if isinstance(r, UsageError))


def test_an_empty_folder_is_taken_one_with_anything_in_it_is_not(tmp_path):
    (tmp_path / "empty").mkdir()
    assert runfolder.reserve(str(tmp_path / "empty"), model="m", data="d", continuing=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(UsageError) as refused:
        runfolder.reserve(str(mine), model="m", data="d", continuing=False)
    assert str(refused.value) == (  # not "add --resume": a folder of the user's has no checkpoint
        f"--out {mine} already exists and is not empty; multigpu never overwrites a run: choose "
        f"another --out, or leave it out for a new timestamped folder ({mine} is no run folder: "
        "it holds notes.txt, left as they are)")
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        runfolder.reserve(str(tmp_path / "file"), model="m", data="d", continuing=False)


def test_a_run_folder_is_taken_again_only_to_continue_it(tmp_path):
    run = runfolder.reserve(str(tmp_path / "run"), model="m", data="d", continuing=False)
    runfolder.write_config(run, {"model": "m"})
    folder_users.release(run)  # as a run's end does: this process trains on there next
    assert runfolder.reserve(str(run), model="m", data="d", continuing=True) == run
    runfolder.append_metrics(run, {"epoch": 1})  # an epoch trained: the folder is a run's now
    with pytest.raises(UsageError, match=r"already exists and is not empty.*\(to continue that "
                       r"run, add --resume\)$"):
        runfolder.reserve(str(run), model="m", data="d", continuing=False)
    assert json.loads((run / "config.json").read_text()) == {"model": "m"}  # left as it was


def _lines(out):
    return [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _write_lines(out, text):
    (out / "metrics.jsonl").write_text(text)


def test_reconcile_puts_back_the_line_of_the_checkpointed_epoch(tmp_path):
    _write_lines(tmp_path, '{"epoch": 1}\n{"epoch": 2}\n')
    runfolder.reconcile_metrics(tmp_path, 3, {"epoch": 3, "val_loss": 0.5})
    assert (tmp_path / "metrics.jsonl").read_text() == (
        '{"epoch": 1}\n{"epoch": 2}\n{"epoch": 3, "val_loss": 0.5}\n'), "the checkpoint's record, whole"


def test_reconcile_drops_a_torn_line_and_lines_ahead_of_the_checkpoint(tmp_path):
    _write_lines(tmp_path, '{"epoch": 1, "val_loss": 0.9}\n{"epoch": 2, "val_loss": 0.7}\n'
                           '{"epoch": 3}\n{"epo')
    runfolder.reconcile_metrics(tmp_path, 2, {"epoch": 2, "val_loss": 0.7})
    assert (tmp_path / "metrics.jsonl").read_text() == (
        '{"epoch": 1, "val_loss": 0.9}\n{"epoch": 2, "val_loss": 0.7}\n')


def test_reconcile_in_a_folder_that_began_with_a_resume_adds_no_earlier_epoch(tmp_path):
    runfolder.reconcile_metrics(tmp_path, 4, {"epoch": 4})  # restarted before its first epoch ended
    assert not (tmp_path / "metrics.jsonl").exists()
    runfolder.reconcile_metrics(tmp_path, 1, {"epoch": 1})  # a run's own first epoch
    assert _lines(tmp_path) == [1]


def test_node_0_claims_a_folder_where_another_node_already_writes_its_logs(tmp_path):
    """On a shared filesystem node 1's launcher may make OUT/logs/ before node 0 claims OUT
    (seen in 1 of 4 two-node runs on a busy machine: node 0 then refused --out)."""
    out = tmp_path / "run"
    (out / runfolder.LOGS / "node1").mkdir(parents=True)
    with pytest.raises(UsageError, match="already exists and is not empty"):
        runfolder.reserve(str(out), model="m", data="d", continuing=False)
    assert runfolder.reserve(str(out), model="m", data="d", continuing=False, nodes_log=True) == out
    (tmp_path / "other" / "notes.txt").parent.mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="already exists and is not empty"):
        runfolder.reserve(str(tmp_path / "other"), model="m", data="d", continuing=False, nodes_log=True)


def test_a_continued_run_finds_the_batch_size_it_trained_with(tmp_path):
    from multigpu.train.rundir.runfolder import trained_batch_size

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text('{"batch_size": 192}')
    assert trained_batch_size(run, None) is None, "no checkpoint yet: a new run searches"
    (run / "checkpoints" / "step-000000010.pt").write_bytes(b"x")
    assert trained_batch_size(run, None) == 192
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert trained_batch_size(fresh, str(run)) == 192
    assert trained_batch_size(fresh, str(run / "checkpoints" / "step-000000010.pt")) == 192
    (run / "config.json").write_text('{"batch_size": "auto"}')
    assert trained_batch_size(fresh, str(run)) is None


def test_a_users_own_config_json_is_never_taken_as_an_untrained_run(tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "config.json").write_text('{"lr": 0.1, "note": "my hydra config"}')
    with pytest.raises(UsageError, match="already exists and is not empty"):
        runfolder.reserve(str(exp), model="m", data="d", continuing=False)
    assert (exp / "config.json").read_text() == '{"lr": 0.1, "note": "my hydra config"}'
    assert not runfolder.untrained_run_folder(exp)


def test_an_untrained_run_folder_of_ours_is_taken_again(tmp_path):
    run = runfolder.reserve(str(tmp_path / "run"), model="m", data="d", continuing=False)
    folder_users.release(run)  # the earlier launch is gone (a kill -9 during its start-up)
    (run / "logs" / "launch-1").mkdir(parents=True)
    assert runfolder.untrained_run_folder(run)
    assert runfolder.reserve(str(run), model="m", data="d", continuing=False) == run
    assert (run / "logs" / "launch-1").is_dir()  # the earlier launch's logs stay


def test_where_locks_are_unknown_an_untrained_folder_is_refused_saying_why(tmp_path, monkeypatch):
    import errno
    import fcntl

    run = runfolder.reserve(str(tmp_path / "run"), model="m", data="d", continuing=False)
    folder_users.release(run)

    def no_locks(fd, op):  # what flock answers on a filesystem without it (ENOLCK)
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(UsageError, match="cannot be told here \\(this filesystem has no file locks\\)"):
        runfolder.reserve(str(run), model="m", data="d", continuing=False)


def test_removing_an_untrained_folder_removes_a_saves_temporary_shard_folder(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / ".step-000000001.pt.abcd.tmp" / "shards").mkdir(parents=True)
    (run / "checkpoints" / ".step-000000001.pt.abcd.tmp" / "shards" / "0.distcp").write_bytes(b"x")
    (run / "config.json").write_text('{"status": "starting"}\n')
    assert runfolder.nothing_trained(run)
    runfolder.remove_untrained(run, up_to=run)
    assert not run.exists()


def test_a_forked_child_of_the_holder_does_not_keep_the_folder_held(tmp_path):
    """A DataLoader worker forked from a rank: once the rank is gone, the folder is free even while
    the worker still lives."""
    import os

    run = tmp_path / "run"
    run.mkdir()
    r, w = os.pipe()  # the worker lives until the test closes w
    ready_r, ready_w = os.pipe()  # the worker says it runs (its fork handlers have run)
    holder = os.fork()
    if holder == 0:  # the rank: holds the folder, forks a worker that lives on, then dies
        folder_users.hold(run)
        if os.fork() == 0:
            os.close(w)
            os.write(ready_w, b"1")
            os.read(r, 1)
            os._exit(0)
        os._exit(0)
    os.close(r)
    os.close(ready_w)
    os.waitpid(holder, 0)
    try:
        assert os.read(ready_r, 1) == b"1"
        assert folder_users.in_use(run) is False, folder_users.holders(run)
    finally:
        os.close(w)  # the worker reads EOF and exits
        os.close(ready_r)
