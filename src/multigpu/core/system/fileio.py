"""Files that appear whole or not at all: the one way multigpu writes a file a crash must not break
(a folder made whole, a sharded checkpoint's or bench's pictures, is built under a temporary name
of its own and renamed by its writer).

`atomic_write(path, write)`:
- writes to a temporary file with a unique name beside `path` (two writers never share one, and a
  crashed writer's leftover is recognisable: `.NAME.<random>.tmp`);
- flushes and fsyncs it, gives it the mode the user's umask gives any new file (mkstemp alone
  leaves 0600, so a checkpoint would be unreadable to the user's group), renames it over `path`,
  then fsyncs the folder, so that the rename itself survives a power cut;
- on any error removes the temporary file and leaves `path` as it was.

`atomic_link(src, dst)` makes `dst` a second name of `src` (a hard link, so no bytes are copied;
a copy where the filesystem has no hard links), replacing `dst` atomically.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO
from collections.abc import Callable

TEMP_SUFFIX = ".tmp"


def check_can_make(path: str | os.PathLike, option: str, *, file: bool = False) -> None:
    """Stop in one line (UsageError) when `path`, given as `option`, cannot be made or written:
    a file where a folder must be (or a folder where a file must), a folder that cannot be made
    or written. Tried as the command would, by making (and removing) a folder in the nearest one
    that exists: os.access says yes to root in /proc, where nothing can be made."""
    from multigpu.core.errors import UsageError

    p = Path(path)
    if p.is_dir() and file:
        raise UsageError(f"{option} {path}: that is a folder; give a file's path in it, e.g. "
                         f"{option} {p / 'out'}")
    if p.exists() and not p.is_dir() and not file:
        raise UsageError(f"{option} {path}: a file is there, not a folder; give another path")
    folder = p if p.is_dir() else p.parent if file else p
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: {folder} is a file, not a folder; give a path whose "
                         "parents are folders")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".multigpu-check-", dir=folder))
    except OSError as exc:
        raise UsageError(f"{option} {path}: nothing can be made in {folder} "
                         f"({exc.strerror or exc}); give a folder you can write") from None


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (os.umask would set it,
    briefly, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # read once, on the importing (main) thread
DIR_MODE = 0o777 & ~_umask()


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename or unlink in `folder` durable. Filesystems that cannot fsync a folder are
    skipped silently (nothing more can be done there)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call `write(f)` on a temporary file, then put it in place of `path` (see module docstring)."""
    return _atomic_write(path, write)[0]


def atomic_write_hashed(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> tuple[Path, str]:
    """atomic_write, and the file's SHA-256, hashed as the bytes go out rather than read back (a
    checkpoint of many GB is not read twice); read back only if `write` moved in the file."""
    path, f = _atomic_write(path, write)
    return path, f.digest.hexdigest() if f.digest is not None else sha256_file(path)


def _atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> tuple[Path, _Writes]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    f = _Writes(os.fdopen(fd, "wb"))
    try:
        with f.raw:
            write(f)
            f.raw.flush()
            os.fsync(f.raw.fileno())
            os.fchmod(f.raw.fileno(), FILE_MODE)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if f.error is not None and exc is not f.error:
            raise f.error from None  # the disk's error, not what a serialiser made of it
        raise
    fsync_dir(path.parent)
    return path, f


class _Writes:
    """A file that remembers the first OSError of a write (torch.save turns a failed write into
    "RuntimeError: [enforce fail at inline_container.cc] unexpected pos", hiding "No space left
    on device"), and hashes what is written while the writes run in order through write(). Any
    other way to change the file (seek, truncate, the descriptor itself) drops the hash: the file
    is then read back instead."""

    _KEEP_HASH = frozenset({"flush", "tell", "closed", "name", "mode", "writable", "seekable",
                            "readable", "isatty"})

    def __init__(self, raw):
        self.raw, self.error = raw, None
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        try:
            written = self.raw.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        if self.digest is not None:
            if written == memoryview(data).nbytes:
                self.digest.update(data)
            else:  # a short write: the caller writes the rest again, hash the file instead
                self.digest = None
        return written

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        if name not in self._KEEP_HASH:  # seek, truncate, fileno, ...: bytes may change unseen
            self.digest = None
        return getattr(self.raw, name)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))


def atomic_write_csv(path: str | os.PathLike, header: list[str], rows: list[dict]) -> Path:
    """A CSV file of `rows` (dicts; a key missing from a row is an empty cell), written whole."""
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, header, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write_text(path, buf.getvalue())


def atomic_link(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Make `dst` name the same bytes as `src`, atomically replacing what `dst` was."""
    src, dst = Path(src), Path(dst)
    while True:
        tmp = dst.parent / f".{dst.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        try:
            os.link(src, tmp)
            break
        except FileExistsError:  # that random name is taken: draw another
            continue
        except OSError:  # no hard links on this filesystem: copy, with the same guarantees
            return atomic_write(dst, lambda f: _copy_into(src, f))
    try:
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dst.parent)
    return dst


def _copy_into(src: Path, f: BinaryIO) -> None:
    with open(src, "rb") as s:
        shutil.copyfileobj(s, f, 16 << 20)


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def is_temp_name(name: str) -> bool:
    """A leftover of an interrupted atomic write (see the module docstring)."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)
