"""The checkpoints of one run folder, kept so that none is ever lost or half-written.

    checkpoints/
        step-000001200.pt     the --keep newest checkpoints, named by the run's step count
        step-000001200.<random>.shards/  with a sharding strategy: every rank's part of the
                              model and optimizer state, which the step file leaves out
                              (sharded_checkpoint.py); the manifest names each entry's folder
        last.pt               the newest one (a second name of the same file: no bytes copied)
        best.pt               the one with the best validation score so far
        manifest.json         every complete checkpoint: file, size, SHA-256, where the run stood

Writing (one writer per folder, held by a lock for the life of the run):
1. the step file is written atomically (fileio.atomic_write: unique temporary name, fsync,
   rename, fsync of the folder);
2. its size and SHA-256 go into the manifest, itself written atomically: only now is the
   checkpoint complete; last.pt (and best.pt) then become names of it;
3. only then are checkpoints beyond the --keep newest removed.
A crash at any point leaves every checkpoint that was complete before it, and at worst a
temporary file or an unlisted step file, which the next writer removes, or last.pt one
checkpoint behind the manifest, which the next writer points forward.

Reading: the newest complete checkpoint whose size and checksum match and which torch can load;
each one skipped is reported in one line and the one before it is tried. Naming the newest
complete one (newest_complete) reads sizes only: a launcher on its way out says it in moments.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from collections.abc import Callable

import torch

from multigpu.core.checkpoints import checkpoint, sharded_checkpoint
from multigpu.core.system import fileio, locks
from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.core.checkpoints.checkpoint_schema import BEST_FILE, LAST_FILE, MANIFEST_FILE, step_of
from multigpu.core.checkpoints.checkpoint_schema import step_file_name as step_file_name  # its users import it here
from multigpu.core.errors import UsageError
from multigpu.core.checkpoints.sharded_checkpoint import is_shards_name

LOCK = ".writer.lock"
LOCK_WAIT_SECONDS = 60  # a writer of a run that was just stopped may still be finishing its save


@dataclass
class Entry:
    """One complete checkpoint, as the manifest lists it."""
    file: str
    size: int
    sha256: str
    global_step: int
    run: dict = field(default_factory=dict)  # where the run stood (RunState.summary())
    time: float = 0.0
    shards: str | None = None  # its folder of shards, when the step file leaves them out


class CheckpointStore:
    def __init__(self, folder: str | os.PathLike, keep: int = 3):
        if keep < 1:
            raise UsageError(f"--keep {keep} must be at least 1 (the newest checkpoint is always kept)")
        self.folder, self.keep = Path(folder), keep
        self._lock_fd: int | None = None

    # --- reading -----------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Complete checkpoints, oldest first; [] when the folder has no manifest."""
        return _listed(self._read_manifest())

    def best_entry(self) -> Entry | None:
        return _best(self._read_manifest())

    def newest_complete(self) -> Path | None:
        """The newest checkpoint the manifest lists whose files are all there at the sizes they
        were written with (the step file; for a sharded one, every file of its shards folder as
        its step file lists them), or None: written whole by the protocol above and not cut
        short since. Cheap on any size and file system (no byte of a large file is read, no
        checksum), so a launcher can say it on its way out; load_newest checks the SHA-256."""
        for entry in reversed(self.entries()):
            if _complete(self.folder / entry.file, entry):
                return self.folder / entry.file
        return None

    def has_checkpoints(self) -> bool:
        return bool(self._candidates())

    def load_newest(self, warn: Callable[[str], None]) -> tuple[dict, Path] | None:
        """The newest checkpoint that verifies and loads, and its path; None when there is none.
        Every damaged one is reported through `warn` (one line each) and skipped. Raises
        CheckpointError when there are checkpoints but none of them can be read."""
        candidates = self._candidates()
        problems = []
        for path, entry in candidates:
            try:
                try:
                    state = verify_and_load(path, entry)
                except checkpoint.CheckpointError as first:
                    second = self._second_name(path, entry)  # last.pt/best.pt, same bytes
                    if second is None:
                        raise
                    state = verify_and_load(second, entry)
                    warn(f"checkpoint {path} is not the file the manifest lists ({first}); "
                         f"{second.name} holds that file and is used")
                    path = second
            except schema.NewerFormatError:
                raise  # not damaged: an older multigpu must not go on from an older one
            except checkpoint.CheckpointError as exc:
                problems.append(f"{path.name}: {exc}")
                warn(f"checkpoint {path} is damaged ({exc}); "
                     + ("trying the one before it" if (path, entry) != candidates[-1] else "it was the last one"))
                continue
            return state, path
        if problems:
            raise checkpoint.CheckpointError(f"no readable checkpoint in {self.folder}: "
                                             + "; ".join(problems))
        return None

    def _second_name(self, path: Path, entry: Entry | None) -> Path | None:
        """last.pt or best.pt when it holds the bytes the manifest lists for `entry` and `path`
        does not: a save of the same step again was stopped after its new file replaced the
        listed one and before the manifest said so; the second name still has the listed file."""
        if entry is None:
            return None
        for name in (LAST_FILE, BEST_FILE):
            other = self.folder / name
            if other.is_file() and not _same_file(other, path) and _matches(other, entry):
                return other
        return None

    def _candidates(self) -> list[tuple[Path, Entry | None]]:
        """Newest first. From the manifest when there is one; otherwise (a run folder of an older
        multigpu, or a lost manifest) last.pt and the step files, unverified."""
        if not self.folder.is_dir():
            return []
        listed = self.entries()
        if listed or (self.folder / MANIFEST_FILE).exists():
            return [(self.folder / e.file, e) for e in reversed(listed)]
        steps = sorted((p for p in self.folder.iterdir() if step_of(p.name) is not None),
                       key=lambda p: step_of(p.name), reverse=True)
        last = self.folder / LAST_FILE
        return [(p, None) for p in ([last] if last.is_file() else []) + steps]

    def _read_manifest(self) -> dict | None:
        path = self.folder / MANIFEST_FILE
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # written atomically, so only outside damage does this
            raise checkpoint.CheckpointError(f"{path} cannot be read ({exc}); move it away to fall "
                                             "back to the checkpoint files themselves") from None
        return schema.read_manifest(manifest, str(path))

    # --- writing -----------------------------------------------------------------------------
    def acquire(self) -> None:
        """Become this folder's one writer (waits for a stopping writer to finish its save)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = self._locked_file()
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        self._remove_leftovers()
        self._repair_links()

    def _locked_file(self) -> int:
        """The lock file's descriptor, flocked. A writer removes the file as it releases it (a
        finished run keeps no lock file): one that waited on the removed file holds a lock no
        one else can see, so it opens the file again until the lock it holds is on the file
        that is there."""
        path = self.folder / LOCK
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, fileio.FILE_MODE)
            if locks.lock(fd, wait=LOCK_WAIT_SECONDS, poll=0.5) is False:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise UsageError(f"another multigpu process (pid {holder}) is still writing "
                                 f"checkpoints to {self.folder}; wait for it to end or stop it, "
                                 "then start again")
            try:
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def release(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):  # removed while held: see _locked_file
                (self.folder / LOCK).unlink()
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    def write(self, state: dict, *, global_step: int, run: dict, best: bool) -> Path:
        """Save `state` as the newest checkpoint (steps 1-3 of the module docstring)."""
        assert self._lock_fd is not None, "acquire() first"
        name = step_file_name(global_step)
        path, sha256 = fileio.atomic_write_hashed(self.folder / name, lambda f: torch.save(state, f))
        entry = Entry(name, path.stat().st_size, sha256, global_step, run,
                      round(time.time(), 3), (state.get(schema.SHARDS) or {}).get(schema.SHARDS_DIR))
        manifest = self._read_manifest()
        listed = [e for e in _listed(manifest) if e.file != name]
        replaced = [e for e in _listed(manifest) if e.file == name]
        kept = (listed + [entry])[-self.keep:]
        old_best = _best(manifest)
        best_entry = replace(entry, file=BEST_FILE) if best else old_best
        fileio.atomic_write_text(self.folder / MANIFEST_FILE, json.dumps({
            schema.FORMAT: schema.MANIFEST_FORMAT,
            schema.MANIFEST_CHECKPOINTS: [asdict(e) for e in kept],
            schema.MANIFEST_BEST: asdict(best_entry) if best_entry else None}, indent=1) + "\n")
        if best:
            fileio.atomic_link(path, self.folder / BEST_FILE)
        fileio.atomic_link(path, self.folder / LAST_FILE)
        removed = listed[:len(listed) + 1 - len(kept)]
        for old in removed:
            (self.folder / old.file).unlink(missing_ok=True)
        self._remove_shards(removed + replaced, kept, best_entry, old_best)
        return path

    def _remove_shards(self, dropped: list[Entry], kept: list[Entry], best: Entry | None,
                       old_best: Entry | None) -> None:
        """The shard folders of checkpoints just dropped (beyond --keep, written again at their
        step, or no longer best.pt) that no kept checkpoint and no best.pt names. Only those: the
        next save's folder may be being written beside this one."""
        needed = {e.shards for e in kept} | {b.shards for b in (best,) if b}
        gone = {e.shards for e in dropped} | {b.shards for b in (old_best,) if b}
        for name in gone - needed - {None}:
            shutil.rmtree(self.folder / name, ignore_errors=True)

    def _repair_links(self) -> None:
        """last.pt and best.pt name what the manifest says (a crash between the manifest and the
        links leaves them one checkpoint behind), and only files whose bytes the manifest lists:
        when a step saved again was stopped between its file and the manifest, the step file is
        the unlisted new one and last.pt still the listed one, which is put back."""
        entries = self.entries()
        for name, entry in ((LAST_FILE, entries[-1] if entries else None),
                            (BEST_FILE, self.best_entry())):
            if entry is None:
                continue
            target, link = self.folder / step_file_name(entry.global_step), self.folder / name
            if target.is_file() and link.exists() and _same_file(link, target):
                continue
            if target.is_file() and _matches(target, entry):
                fileio.atomic_link(target, link)
            elif name == LAST_FILE and link.is_file() and _matches(link, entry):
                fileio.atomic_link(link, target)

    def _remove_leftovers(self) -> None:
        """Temporary files of interrupted writes, and step files the manifest does not list."""
        manifest = self._read_manifest()
        if manifest is None and any(step_of(p.name) is not None for p in self.folder.iterdir()):
            return  # no manifest to tell complete from incomplete: remove nothing
        listed = {e.file for e in _listed(manifest)}
        needed = {e.shards for e in _listed(manifest) + [_best(manifest)] if e}
        for p in self.folder.iterdir():
            if p.is_dir() and (fileio.is_temp_name(p.name) or (
                    is_shards_name(p.name) and p.name not in needed)):
                shutil.rmtree(p, ignore_errors=True)
            elif fileio.is_temp_name(p.name) or (step_of(p.name) is not None
                                                 and p.name not in listed):
                with contextlib.suppress(OSError):
                    p.unlink()


def _listed(manifest: dict | None) -> list[Entry]:
    """The complete checkpoints a manifest lists, oldest first."""
    return [Entry(**e) for e in (manifest or {}).get(schema.MANIFEST_CHECKPOINTS, [])]


def _best(manifest: dict | None) -> Entry | None:
    """best.pt's entry in a manifest, if any."""
    best = (manifest or {}).get(schema.MANIFEST_BEST)
    return Entry(**best) if best else None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _matches(path: Path, entry: Entry) -> bool:
    """Whether `path` holds the bytes the manifest lists for `entry` (size, then SHA-256)."""
    try:
        return path.stat().st_size == entry.size and fileio.sha256_file(path) == entry.sha256
    except OSError:
        return False


def _complete(path: Path, entry: Entry) -> bool:
    """`path` has the manifest's size and, when the entry has shards, its step file (small:
    the tensors are in the shards) lists files that are all in the folder at their sizes."""
    try:
        if path.stat().st_size != entry.size:
            return False
    except OSError:
        return False
    if entry.shards is None:
        return True
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        folder = sharded_checkpoint.folder_of(state, path.parent)
        sharded_checkpoint.verify(folder, state[schema.SHARDS][schema.SHARDS_FILES])
    except Exception:  # noqa: BLE001 - unreadable, not ours, or a shard gone: not complete
        return False
    return True


def verify_and_load(path: Path, entry: Entry | None) -> dict:
    """Load `path` after checking its size and SHA-256 against the manifest `entry` (if any)."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise checkpoint.CheckpointError(f"cannot read it: {exc.strerror or exc}") from None
    if entry is not None:
        if size != entry.size:
            raise checkpoint.CheckpointError(f"{size} bytes, the manifest says {entry.size}: "
                                             "truncated or overwritten")
        if fileio.sha256_file(path) != entry.sha256:
            raise checkpoint.CheckpointError("its SHA-256 differs from the manifest's: the file "
                                             "was changed or corrupted after it was written")
    state = checkpoint.load(path)
    shards = sharded_checkpoint.folder_of(state, path.parent)
    if shards is not None:
        sharded_checkpoint.verify(shards, state[schema.SHARDS][schema.SHARDS_FILES], path)
    return state
