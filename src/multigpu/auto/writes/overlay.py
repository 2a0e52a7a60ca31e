"""One rank's copy-on-write view of the filesystem: which path it writes, reads and lists where,
for files.py, which routes the script's file functions through it on ranks other than 0.

A path the overlay tracks is recorded, by its absolute name, once the rank writes, makes, deletes
or renames it: OWN (its copy holds it; a folder merged with the user's), OPAQUE (a folder of its
own hiding the user's: made again after it deleted it), GONE (deleted by this rank). What is not
recorded is the user's, as it is, unless a folder above is GONE or OPAQUE. The copies live at
`root` + the absolute path; the folders in `passing` are never tracked.
"""
from __future__ import annotations

import errno
import io
import os
import shutil
import stat
import types

OWN, OPAQUE, GONE = "own", "opaque", "gone"  # a path's record: this rank's copy (a folder's
# merged with the user's folder), its folder that hides the user's folder, deleted by this rank
real = types.SimpleNamespace(  # the functions themselves, taken before files.py patches them
    open=io.open, os_open=os.open, stat=os.stat, lstat=os.lstat, chmod=os.chmod, utime=os.utime,
    chown=os.chown, lchown=os.lchown,
    mkdir=os.mkdir, rmdir=os.rmdir, remove=os.remove, unlink=os.unlink, rename=os.rename,
    replace=os.replace, listdir=os.listdir, scandir=os.scandir, rmtree=shutil.rmtree)


def error(cls, code: int, path) -> OSError:
    return cls(code, os.strerror(code), path)


def kind_of(path) -> str | None:
    """"dir", "file" or None (nothing there) for a real path, read past the overlay."""
    try:
        mode = real.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return "dir" if stat.S_ISDIR(mode) else "file"


def there(path) -> bool:
    try:
        real.lstat(path)
    except (OSError, ValueError):
        return False
    return True


class Overlay:
    """One rank's copy-on-write view of the filesystem: `root` holds its copies, `passing` the
    folders it leaves as they are. `state` records, by absolute path, what the rank did there."""

    def __init__(self, root: str, passing: tuple[str, ...]):
        self.root = os.path.abspath(root)
        folders = {os.path.abspath(p) for p in (*passing, root)}
        folders |= {os.path.realpath(p) for p in folders}
        self.passing = tuple(f.rstrip(os.sep) + os.sep for f in folders)
        self.state: dict[str, str] = {}
        self.children: dict[str, set[str]] = {}  # folder -> the names recorded in it (listings)
        self.hiders: set[str] = set()  # folders deleted or hidden: what is below them is too
        self.below_hiders: tuple[str, ...] = ()

    def key(self, path) -> str | None:
        """The absolute path the overlay tracks `path` by; None for what passes untouched."""
        if isinstance(path, int):
            return None
        path = os.fspath(path)
        if isinstance(path, bytes):  # TensorBoard's writer names its files so
            path = os.fsdecode(path)
        # os.path.abspath, cheaper: most paths need no normalizing (it was 2/3 of a lookup)
        full = path if path.startswith(os.sep) else os.path.join(os.getcwd(), path)  # cwd "/" too
        if "/." in full or "//" in full or full.endswith(os.sep):
            full = os.path.normpath(full)
        return None if (full + os.sep).startswith(self.passing) else full

    def copy_of(self, key: str) -> str:
        return self.root + key

    def seen(self, key: str) -> str | None:
        """OWN (the rank's copy holds it), GONE (it deleted it, or a folder above), or None (the
        user's file, as it is)."""
        mark = self.state.get(key)
        if mark is not None:
            return GONE if mark == GONE else OWN
        if not self.hiders or not key.startswith(self.below_hiders):
            return None
        cut = key.rfind(os.sep)
        while cut > 0:  # the nearest recorded folder above decides
            mark = self.state.get(key[:cut])
            if mark == OWN:
                return None
            if mark is not None:  # below a deleted or hiding folder: only the rank's own copies
                return OWN if mark == OPAQUE and there(self.copy_of(key)) else GONE
            cut = key.rfind(os.sep, 0, cut)
        return None

    def record(self, key: str, mark: str, *, folder: bool = False) -> None:
        if folder and mark != OWN:  # list(): the keys at once, another thread may be recording
            for below in [k for k in list(self.state) if k.startswith(key + os.sep)]:
                self._drop(below)
        self._drop(key)
        self.state[key] = mark
        if folder and mark != OWN:
            self.hiders.add(key)
            self.below_hiders = tuple(h + os.sep for h in self.hiders)
        self.children.setdefault(os.path.dirname(key), set()).add(os.path.basename(key))

    def _drop(self, key: str) -> None:
        self.state.pop(key, None)
        if key in self.hiders:
            self.hiders.discard(key)
            self.below_hiders = tuple(h + os.sep for h in self.hiders)

    def forget(self, path) -> None:
        """What this rank sees at `path` is the user's file again (rank 0 has just written it)."""
        key = self.key(path)
        if key is not None:
            self._drop(key)

    def for_read(self, path):
        """Where this rank reads `path`: its copy, the user's file, or nowhere (deleted here)."""
        if not self.state:
            return path
        key = self.key(path)
        seen = None if key is None else self.seen(key)
        if seen is None:
            return path
        if seen == GONE:
            raise error(FileNotFoundError, errno.ENOENT, path)
        return self.copy_of(key)

    def kind(self, key: str) -> str | None:
        seen = self.seen(key)
        return None if seen == GONE else kind_of(self.copy_of(key) if seen else key)

    def for_write(self, key: str, path, *, copy_up: bool) -> str:
        """The rank's copy of `path`, ready to be written: its folder made, the user's file
        copied in first where the write keeps what is there (append, r+)."""
        target, seen = self.copy_of(key), self.seen(key)
        if seen != OWN:  # the user's file, or none (deleted here): a copy of its own begins
            if self.kind(os.path.dirname(key)) != "dir":
                raise error(FileNotFoundError, errno.ENOENT, path)
            kind = kind_of(key) if seen is None else None
            if kind == "dir":
                raise error(IsADirectoryError, errno.EISDIR, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)  # under root: passes untouched
            if copy_up and kind == "file":
                shutil.copyfile(key, target)
        return target

    def write(self, path, do, *, copy_up: bool = False):
        """`do(where)`: the script's write of `path`, made to this rank's own copy."""
        key = self.key(path)
        if key is None:
            return do(path)
        result = do(self.for_write(key, path, copy_up=copy_up))
        self.record(key, OWN)
        return result

    def materialize(self, key: str, path) -> str:
        """The rank's own copy of what it sees at `key` (a rename moves it): copied in from the
        user's file or folder when it has none yet."""
        seen, target = self.seen(key), self.copy_of(key)
        if seen == GONE or (seen is None and not there(key)):
            raise error(FileNotFoundError, errno.ENOENT, path)
        if seen is None:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if kind_of(key) == "dir":  # the folder as the rank sees it, less what it holds already
                shutil.copytree(key, target, dirs_exist_ok=True, ignore=lambda d, names: [
                    n for n in names if os.path.join(d, n) in self.state])
            else:
                shutil.copy2(key, target)
        return target

    def merged(self, key: str) -> bool:
        """Whether the user's folder at `key` is part of what the rank sees there."""
        return self.seen(key) is None or self.state.get(key) == OWN

    def listing(self, key: str, path) -> list[str] | None:
        """The names this rank sees in the folder `key`; None where they are the user's own."""
        seen = self.seen(key)
        if seen is None and key not in self.children:
            return None
        kind = self.kind(key)
        if kind != "dir":
            raise (error(FileNotFoundError, errno.ENOENT, path) if kind is None else
                   error(NotADirectoryError, errno.ENOTDIR, path))
        names = set(real.listdir(self.copy_of(key))) if seen == OWN else set()
        if self.merged(key) and kind_of(key) == "dir":
            names.update(real.listdir(key))
        for name in self.children.get(key, ()):
            (names.add if self.seen(os.path.join(key, name)) == OWN else names.discard)(name)
        return sorted(names)
