"""CheckpointStore: retention, fallback to the previous checkpoint, and faults caused for real
(kill -9 during writes, a file size limit standing in for a full disk)."""
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from multigpu.core.checkpoints import checkpoint
from multigpu.core.system import fileio
from multigpu.train.checkpoints.checkpoint_store import CheckpointStore, step_file_name

SRC = Path(__file__).resolve().parents[2] / "src"
# Writes checkpoints of ~1 MB forever, each holding its step; keeps 2.
WRITER = """
import sys, torch
from multigpu.train.checkpoints.checkpoint_store import CheckpointStore
store = CheckpointStore(sys.argv[1], keep=2)
store.acquire()
entries = store.entries()
step = entries[-1].global_step if entries else 0
print("writing", flush=True)
twice = len(sys.argv) > 2  # each step saved again, as at an epoch's end after an in-epoch save
while True:
    step += 1
    for again in range(1 + twice):
        state = {"w": torch.full((250_000,), float(step)), "step": step, "again": again}
        store.write(state, global_step=step, run={"step": step}, best=step % 3 == 0)
"""


def _write(store: CheckpointStore, step: int, best: bool = False):
    return store.write({"w": torch.full((4,), float(step)), "step": step}, global_step=step,
                       run={"step": step}, best=best)


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(tmp_path / "checkpoints", keep=2)
    s.acquire()
    yield s
    s.release()


def test_keeps_the_newest_k_plus_last_and_best(store):
    for step in range(1, 6):
        _write(store, step, best=step == 2)
    names = sorted(p.name for p in store.folder.iterdir() if not p.name.startswith("."))
    assert names == ["best.pt", "last.pt", "manifest.json", step_file_name(4), step_file_name(5)]
    assert [e.global_step for e in store.entries()] == [4, 5]
    assert checkpoint.load(store.folder / "last.pt")["step"] == 5
    assert checkpoint.load(store.folder / "best.pt")["step"] == 2  # its step file is long gone
    assert store.best_entry().global_step == 2


def test_a_truncated_newest_checkpoint_is_reported_and_the_previous_one_used(store):
    _write(store, 1)
    newest = _write(store, 2)
    with open(newest, "r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    warnings = []
    state, path = store.load_newest(warnings.append)
    assert state["step"] == 1 and path.name == step_file_name(1)
    assert len(warnings) == 1 and str(newest) in warnings[0] and "truncated" in warnings[0]


def test_a_changed_byte_is_caught_by_the_checksum(store):
    _write(store, 1)
    newest = _write(store, 2)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    warnings = []
    state, _ = store.load_newest(warnings.append)
    assert state["step"] == 1 and "SHA-256" in warnings[0]


def test_when_every_checkpoint_is_damaged_the_error_names_them(store):
    why = {}
    for step in (1, 2):
        path = _write(store, step)
        why[path.name] = f"16 bytes, the manifest says {path.stat().st_size}: truncated or overwritten"
        path.write_bytes(b"not a checkpoint")
    warnings = []
    with pytest.raises(checkpoint.CheckpointError) as error:
        store.load_newest(warnings.append)
    newest, first = step_file_name(2), step_file_name(1)
    assert str(error.value) == (f"no readable checkpoint in {store.folder}: {newest}: {why[newest]}; "
                                f"{first}: {why[first]}")
    assert warnings == [
        f"checkpoint {store.folder / newest} is damaged ({why[newest]}); trying the one before it",
        f"checkpoint {store.folder / first} is damaged ({why[first]}); it was the last one"]


SHARD_FILES = {".metadata": 40, "__0_0.distcp": 300, "__1_0.distcp": 300}


def _write_sharded(store: CheckpointStore, step: int) -> Path:
    """A checkpoint laid out as a sharding strategy leaves it: a shards folder beside a step file
    that names it and the size of each of its files (sharded_checkpoint.save)."""
    name = f"{step_file_name(step)[:-len('.pt')]}.{step:08x}.shards"
    (store.folder / name).mkdir()
    for file, size in SHARD_FILES.items():
        (store.folder / name / file).write_bytes(b"s" * size)
    return store.write({"model": None, "shards": {"dir": name, "files": dict(SHARD_FILES)},
                        "step": step}, global_step=step, run={"step": step}, best=False)


def test_the_newest_complete_checkpoint_skips_a_truncated_newest_one(store):
    _write(store, 1)
    newest = _write(store, 2)
    assert store.newest_complete() == newest
    with open(newest, "r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    assert store.newest_complete() == store.folder / step_file_name(1)


def test_a_sharded_checkpoint_whose_shards_folder_lost_a_file_is_not_complete(store):
    first, newest = _write_sharded(store, 1), _write_sharded(store, 2)
    assert store.newest_complete() == newest
    shards = store.folder / store.entries()[-1].shards
    (shards / "__1_0.distcp").unlink()
    assert store.newest_complete() == first
    with open(store.folder / store.entries()[0].shards / "__0_0.distcp", "r+b") as f:
        f.truncate(100)  # a shard cut short
    assert store.newest_complete() is None


def test_a_big_checkpoint_is_found_complete_without_being_read(store):
    """2 GiB that take no disk (a sparse file): reading them for a checksum takes seconds, a
    check of what was written whole a few stat calls."""
    newest = _write(store, 1)
    os.truncate(newest, 2 * 2**30)
    manifest = json.loads((store.folder / "manifest.json").read_text())
    manifest["checkpoints"][-1]["size"] = 2 * 2**30  # as if it had been written that big
    (store.folder / "manifest.json").write_text(json.dumps(manifest))
    began = time.perf_counter()
    found = store.newest_complete()
    took = time.perf_counter() - began
    assert took < 0.5, f"{took:.2f} s: the check read the file"
    assert found == newest


def test_a_second_writer_is_refused_with_the_holders_pid(store, monkeypatch):
    import multigpu.train.checkpoints.checkpoint_store as cs

    monkeypatch.setattr(cs, "LOCK_WAIT_SECONDS", 0.2)
    other = CheckpointStore(store.folder)
    with pytest.raises(cs.UsageError, match=f"pid {os.getpid()}"):
        other.acquire()


def test_a_finished_writer_leaves_no_lock_file_and_one_waiting_holds_the_file_that_is_there(tmp_path):
    import threading

    import multigpu.train.checkpoints.checkpoint_store as cs

    first = CheckpointStore(tmp_path)
    first.acquire()
    _write(first, 1)
    second = CheckpointStore(tmp_path)
    waiter = threading.Thread(target=second.acquire)  # opens the lock file, waits for the flock
    waiter.start()
    time.sleep(0.3)  # it polls every 0.5 s
    first.release()
    waiter.join(timeout=10)
    # it held the lock on the file the first removed at one point: it must hold the one now there
    assert os.path.samestat(os.fstat(second._lock_fd), os.stat(tmp_path / cs.LOCK))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cs, "LOCK_WAIT_SECONDS", 0.2)
        with pytest.raises(cs.UsageError, match=f"pid {os.getpid()}"):
            CheckpointStore(tmp_path).acquire()  # one writer at a time
    second.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "manifest.json", step_file_name(1)]


def test_a_step_saved_again_and_stopped_before_the_manifest_keeps_the_listed_one(tmp_path):
    # the state a kill leaves between the new file of a step saved again (the epoch's end after
    # an in-epoch save at the same step) and the manifest: the step file is unlisted bytes
    first = CheckpointStore(tmp_path, keep=1)
    first.acquire()
    _write(first, 5)
    first.release()
    fileio.atomic_write(tmp_path / step_file_name(5),  # as write() does first: a new inode
                        lambda f: torch.save({"w": torch.zeros(4), "step": 5, "again": True}, f))
    warned = []
    state, path = CheckpointStore(tmp_path, keep=1).load_newest(warned.append)
    assert (state["w"][0], path.name) == (5.0, "last.pt")  # the listed bytes
    (note,) = warned
    assert note.startswith(f"checkpoint {tmp_path / step_file_name(5)} is not the file the "
                           "manifest lists (") and note.endswith("); last.pt holds that file and is used")
    second = CheckpointStore(tmp_path, keep=1)
    second.acquire()  # puts the listed file back under its step name
    assert checkpoint.load(tmp_path / step_file_name(5))["w"][0] == 5.0
    assert os.path.samefile(tmp_path / step_file_name(5), tmp_path / "last.pt")
    second.release()


def test_leftovers_of_interrupted_writes_go_when_the_next_writer_starts(tmp_path):
    first = CheckpointStore(tmp_path, keep=2)
    first.acquire()
    _write(first, 1)
    first.release()
    (tmp_path / ".step-000000002.pt.k3j2.tmp").write_bytes(b"half")
    (tmp_path / step_file_name(2)).write_bytes(b"renamed, never listed")
    second = CheckpointStore(tmp_path, keep=2)
    second.acquire()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".writer.lock") == [
        "last.pt", "manifest.json", step_file_name(1)]
    second.release()


@pytest.mark.parametrize("twice", [False, True], ids=["each-step-once", "each-step-twice"])
def test_kill_9_during_writes_never_loses_or_corrupts_a_checkpoint(tmp_path, twice):
    folder = tmp_path / "checkpoints"
    rng = random.Random(11)
    env = dict(os.environ, PYTHONPATH=str(SRC))
    for attempt in range(8):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder), *(["twice"] * twice)],
                                  env=env, stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "writing"
        time.sleep(rng.uniform(0.05, 0.4))
        writer.kill()
        writer.wait()
        store = CheckpointStore(folder, keep=2)
        warnings = []
        state, path = store.load_newest(warnings.append)
        # nothing damaged; a kill inside a step's second save leaves its listed file in last.pt
        assert all(w.endswith("last.pt holds that file and is used") for w in warnings), \
            f"attempt {attempt}: {warnings}"
        entries = store.entries()
        assert state["step"] == entries[-1].global_step and state["w"][0] == state["step"]
        for e in entries:  # every listed checkpoint verifies and loads
            assert checkpoint.load(folder / e.file)["step"] == e.global_step
        # killed between the manifest and the link, last.pt is one behind until the next writer
        assert checkpoint.load(folder / "last.pt")["step"] in {e.global_step for e in entries}
    assert entries[-1].global_step > 8, "the writer made progress between kills"
    store.acquire()
    assert checkpoint.load(folder / "last.pt")["step"] == entries[-1].global_step
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    store.release()


def _limit_file_size():
    # Files may not grow past 256 KiB: a write beyond fails with EFBIG (Python ignores SIGXFSZ),
    # as a write on a full disk fails with ENOSPC. The checkpoint below is ~1 MB.
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))


def test_a_full_disk_fails_the_save_and_leaves_the_previous_checkpoint_intact(tmp_path):
    folder = tmp_path / "checkpoints"
    store = CheckpointStore(folder, keep=2)
    store.acquire()
    _write(store, 1)
    manifest = (folder / "manifest.json").read_text()
    store.release()
    script = ("import sys, torch\n"
              "from multigpu.train.checkpoints.checkpoint_store import CheckpointStore\n"
              "s = CheckpointStore(sys.argv[1]); s.acquire()\n"
              "try:\n"
              "    s.write({'w': torch.zeros(250_000)}, global_step=2, run={}, best=False)\n"
              "except OSError as e:\n"
              "    print('failed:', e.strerror); sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(SRC)), preexec_fn=_limit_file_size)
    assert proc.returncode == 3, proc.stderr
    assert "File too large" in proc.stdout
    assert (folder / "manifest.json").read_text() == manifest
    assert checkpoint.load(folder / "last.pt")["step"] == 1
    assert sorted(p.name for p in folder.iterdir() if p.name != ".writer.lock") == [
        "last.pt", "manifest.json", step_file_name(1)], "no temporary file left behind"
    assert json.loads(manifest)["checkpoints"][0]["global_step"] == 1
