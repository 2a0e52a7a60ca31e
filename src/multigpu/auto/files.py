"""Files the script writes come out whole and once: rank 0's, as on one process.

Every process runs the script's `save_image(grid, "samples.png")`, `open("log.txt", "w")`,
`np.save`, `savefig`, `shutil.copyfile`: N processes writing one file tear it (4 of 30 PNGs of one
run were corrupt). So rank 0 writes the user's folders as one process would, untouched, and every
other rank writes through a copy-on-write overlay of its own: what it writes lands under the
run's log folder (`<log dir>/files/rank<N>/<the file's absolute path>`), and it reads its own copy
back; what it never wrote it reads from the user's folders. Making, deleting and renaming follow
the same rule (os.makedirs, shutil.rmtree, os.replace, a dataset's download=True): such a rank
deletes only its own copies, and a file of the user's it deletes is hidden from that rank alone.
Rank 0 says once, at its first write, where the other ranks' writes went.

Caught: what goes through Python's file functions: open (io.open, pathlib, numpy, PIL,
matplotlib, torchvision, gzip, zipfile, tarfile, logging and shutil use it), os.open, os.stat and
os.lstat (os.path.exists, isdir...), os.mkdir (os.makedirs), os.rmdir, os.remove/unlink,
os.rename/replace (shutil.move), os.listdir, os.scandir (glob, os.walk), os.chmod and os.utime
(shutil.copy's), shutil.rmtree. Passing untouched: file descriptors, bytes paths, the system temp
folder (tempfile's unique names, torch's compile caches, which compilers and imports read by
name), /dev /proc /sys /run, the user's caches (~/.cache, TORCH_HOME, HF_HOME...), the launcher's
log folder. Not caught (docs/launching.md): writes from C extensions (cv2.imwrite, h5py), from
programs the script starts, from loader workers started by spawn; sockets; a run per rank of an
online logger (wandb).

Cheap on purpose: until a rank writes, a read is one test; after, one dict lookup per path (and
a walk up the path's folders only once the rank deleted something).
"""
from __future__ import annotations

import builtins
import errno
import io
import os
import shutil
import stat
import sys
import tarfile
import tempfile
import types

from multigpu.launcher import trial, watchdog

OWN, OPAQUE, GONE = "own", "opaque", "gone"  # a path's record: this rank's copy (a folder's
# merged with the user's folder), its folder that hides the user's folder, deleted by this rank
CACHE_ENVS = ("XDG_CACHE_HOME", "TORCH_HOME", "HF_HOME", "TRITON_CACHE_DIR",
              "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR")
_PATCHED = ((builtins, "open"), (io, "open"), (tarfile, "bltn_open"), (os, "open"), (os, "stat"),
            (os, "lstat"), (os, "chmod"), (os, "utime"), (os, "mkdir"), (os, "rmdir"),
            (os, "remove"), (os, "unlink"), (os, "rename"), (os, "replace"), (os, "listdir"),
            (os, "scandir"), (shutil, "rmtree"))
_real = types.SimpleNamespace(  # the functions themselves, which the rank's copies go through
    open=io.open, os_open=os.open, stat=os.stat, lstat=os.lstat, chmod=os.chmod, utime=os.utime,
    mkdir=os.mkdir, rmdir=os.rmdir, remove=os.remove, unlink=os.unlink, rename=os.rename,
    replace=os.replace, listdir=os.listdir, scandir=os.scandir, rmtree=shutil.rmtree)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_installed: dict = {}  # "overlay": this rank's Overlay, "saved": what the patches replaced


def _error(cls, code: int, path) -> OSError:
    return cls(code, os.strerror(code), path)


def _kind(path) -> str | None:
    """"dir", "file" or None (nothing there) for a real path, read past the overlay."""
    try:
        mode = _real.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return "dir" if stat.S_ISDIR(mode) else "file"


def _there(path) -> bool:
    try:
        _real.lstat(path)
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

    def key(self, path) -> str | None:
        """The absolute path the overlay tracks `path` by; None for what passes untouched."""
        if isinstance(path, int):
            return None
        path = os.fspath(path)
        if not isinstance(path, str):
            return None  # bytes paths: rare in training scripts, left as they are
        full = os.path.abspath(path)
        return None if (full + os.sep).startswith(self.passing) else full

    def copy_of(self, key: str) -> str:
        return self.root + key

    def seen(self, key: str) -> str | None:
        """OWN (the rank's copy holds it), GONE (it deleted it, or a folder above), or None (the
        user's file, as it is)."""
        mark = self.state.get(key)
        if mark is not None:
            return GONE if mark == GONE else OWN
        if not self.hiders:
            return None
        up, parent = key, os.path.dirname(key)
        while parent != up:  # the nearest recorded folder above decides
            mark = self.state.get(parent)
            if mark == OWN:
                return None
            if mark is not None:  # below a deleted or hiding folder: only the rank's own copies
                return OWN if mark == OPAQUE and _there(self.copy_of(key)) else GONE
            up, parent = parent, os.path.dirname(parent)
        return None

    def record(self, key: str, mark: str, *, folder: bool = False) -> None:
        if folder and mark != OWN:
            for below in [k for k in self.state if k.startswith(key + os.sep)]:
                self._drop(below)
        self._drop(key)
        self.state[key] = mark
        if folder and mark != OWN:
            self.hiders.add(key)
        self.children.setdefault(os.path.dirname(key), set()).add(os.path.basename(key))

    def _drop(self, key: str) -> None:
        self.state.pop(key, None)
        self.hiders.discard(key)

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
            raise _error(FileNotFoundError, errno.ENOENT, path)
        return self.copy_of(key)

    def kind(self, key: str) -> str | None:
        seen = self.seen(key)
        return None if seen == GONE else _kind(self.copy_of(key) if seen else key)

    def for_write(self, key: str, path, *, copy_up: bool) -> str:
        """The rank's copy of `path`, ready to be written: its folder made, the user's file
        copied in first where the write keeps what is there (append, r+)."""
        target = self.copy_of(key)
        if self.seen(key) is None:
            if self.kind(os.path.dirname(key)) != "dir":
                raise _error(FileNotFoundError, errno.ENOENT, path)
            kind = _kind(key)
            if kind == "dir":
                raise _error(IsADirectoryError, errno.EISDIR, path)
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
        if seen == GONE or (seen is None and not _there(key)):
            raise _error(FileNotFoundError, errno.ENOENT, path)
        if seen is None:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if _kind(key) == "dir":  # the folder as the rank sees it, less what it holds already
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
            raise (_error(FileNotFoundError, errno.ENOENT, path) if kind is None else
                   _error(NotADirectoryError, errno.ENOTDIR, path))
        names = set(_real.listdir(self.copy_of(key))) if seen == OWN else set()
        if self.merged(key) and _kind(key) == "dir":
            names.update(_real.listdir(key))
        for name in self.children.get(key, ()):
            (names.add if self.seen(os.path.join(key, name)) == OWN else names.discard)(name)
        return sorted(names)


def _rename(ov: Overlay, real, src, dst, *, src_dir_fd=None, dst_dir_fd=None):
    """os.rename/os.replace on a rank other than 0: the rank's own copy of `src` moves to its
    copy of `dst`; the user's `src`, where that is what it saw, is hidden from it, not moved."""
    ks, kd = (ov.key(src), ov.key(dst)) if src_dir_fd is None and dst_dir_fd is None else (None,
                                                                                           None)
    if ks is None and kd is None:
        return real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    source = ov.materialize(ks, src) if ks else src
    folder = _kind(source) == "dir"
    target = ov.for_write(kd, dst, copy_up=False) if kd else dst
    shutil.move(source, target)  # a copy and a passing path can be on different filesystems
    if ks:
        ov.record(ks, GONE, folder=folder)
    if kd:
        ov.record(kd, OPAQUE if folder else OWN, folder=folder)


def _delete(ov: Overlay, real, want: str):
    """os.remove/unlink (want "file") or os.rmdir ("dir"): the rank's copy goes, and the user's
    file is hidden from the rank, never removed."""
    def delete(path, *, dir_fd=None):
        key = ov.key(path) if dir_fd is None else None
        if key is None:
            return real(path, dir_fd=dir_fd)
        kind = ov.kind(key)
        if kind is None:
            raise _error(FileNotFoundError, errno.ENOENT, path)
        if kind != want:
            raise (_error(IsADirectoryError, errno.EISDIR, path) if want == "file" else
                   _error(NotADirectoryError, errno.ENOTDIR, path))
        if want == "dir":
            names = ov.listing(key, path)
            if names or (names is None and _real.listdir(key)):
                raise _error(OSError, errno.ENOTEMPTY, path)
        if ov.seen(key) == OWN:
            (_real.rmtree if want == "dir" else _real.unlink)(ov.copy_of(key))
        ov.record(key, GONE, folder=want == "dir")
    return delete


def _patches(ov: Overlay) -> dict[tuple[object, str], object]:
    """(module, name) -> what a rank other than 0 calls there instead."""
    def open_(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None,
              closefd=True, opener=None):
        def do(where):
            return _real.open(where, mode, buffering, encoding, errors, newline, closefd, opener)
        if isinstance(file, int):
            return do(file)
        if any(c in mode for c in "wax+"):
            f = ov.write(file, do, copy_up="a" in mode or ("+" in mode and "r" in mode))
        else:
            f = do(ov.for_read(file))
        raw = getattr(f, "buffer", f)
        raw = getattr(raw, "raw", raw)
        if raw.name is not file:
            raw.name = file  # the script's f.name is the path it opened, as without --auto
        return f

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is not None:
            return _real.os_open(path, flags, mode, dir_fd=dir_fd)
        if flags & _WRITE_FLAGS:
            return ov.write(path, lambda where: _real.os_open(where, flags, mode),
                            copy_up=not flags & os.O_TRUNC)
        return _real.os_open(ov.for_read(path), flags, mode)

    def reading(real):
        def call(path, *args, dir_fd=None, **kwargs):
            if dir_fd is not None:
                return real(path, *args, dir_fd=dir_fd, **kwargs)
            return real(ov.for_read(path), *args, **kwargs)
        return call

    def mkdir(path, mode=0o777, *, dir_fd=None):
        key = ov.key(path) if dir_fd is None else None
        if key is None:
            return _real.mkdir(path, mode, dir_fd=dir_fd)
        seen = ov.seen(key)
        # A folder rank 0 has just made is taken as this rank's own, as the one process would
        # have made it itself: `if not os.path.exists(d): os.makedirs(d)` races between ranks.
        if seen == OWN or (seen is None and _kind(key) == "file"):
            raise _error(FileExistsError, errno.EEXIST, path)
        if ov.kind(os.path.dirname(key)) != "dir":
            raise _error(FileNotFoundError, errno.ENOENT, path)
        os.makedirs(ov.copy_of(key), mode, exist_ok=True)
        ov.record(key, OPAQUE if seen == GONE else OWN, folder=True)

    def rmtree(path, ignore_errors=False, *args, **kwargs):
        key = ov.key(path) if kwargs.get("dir_fd") is None else None
        if key is None:
            return _real.rmtree(path, ignore_errors, *args, **kwargs)
        kind = ov.kind(key)
        if kind != "dir":
            if ignore_errors:
                return None
            raise (_error(FileNotFoundError, errno.ENOENT, path) if kind is None else
                   _error(NotADirectoryError, errno.ENOTDIR, path))
        if ov.seen(key) == OWN:
            _real.rmtree(ov.copy_of(key), ignore_errors=True)
        ov.record(key, GONE, folder=True)

    def listdir(path="."):
        key = ov.key(path)
        names = None if key is None else ov.listing(key, path)
        return _real.listdir(path) if names is None else names

    def scandir(path="."):
        key = ov.key(path)
        names = None if key is None else ov.listing(key, path)
        return _real.scandir(path) if names is None else _Scan(ov, path, key, names)

    def renaming(real):
        return lambda src, dst, **fds: _rename(ov, real, src, dst, **fds)

    return {
        (builtins, "open"): open_, (io, "open"): open_, (tarfile, "bltn_open"): open_,
        (os, "open"): os_open, (os, "stat"): reading(_real.stat),
        (os, "lstat"): reading(_real.lstat), (os, "chmod"): reading(_real.chmod),
        (os, "utime"): reading(_real.utime), (os, "mkdir"): mkdir,
        (os, "rmdir"): _delete(ov, _real.rmdir, "dir"),
        (os, "remove"): _delete(ov, _real.remove, "file"),
        (os, "unlink"): _delete(ov, _real.unlink, "file"),
        (os, "rename"): renaming(_real.rename), (os, "replace"): renaming(_real.replace),
        (os, "listdir"): listdir, (os, "scandir"): scandir, (shutil, "rmtree"): rmtree,
    }


class _Scan:
    """os.scandir of a folder this rank changed: the user's entries it still sees, and its own
    (their `path` under the folder the script named, as os.scandir gives it)."""

    def __init__(self, ov: Overlay, path, key: str, names: list[str]):
        own, users = {}, {}
        if ov.seen(key) == OWN:
            with _real.scandir(ov.copy_of(key)) as it:
                own = {e.name: e for e in it}
        if ov.merged(key) and _kind(key) == "dir":
            with _real.scandir(path) as it:
                users = {e.name: e for e in it}
        entries = [_Entry(own[n], os.path.join(os.fspath(path), n))
                   if ov.seen(os.path.join(key, n)) == OWN else users.get(n) for n in names]
        self._it = iter([e for e in entries if e is not None])

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._it = iter(())


class _Entry:
    """A DirEntry of the rank's copy, named by the path the script listed."""

    def __init__(self, entry: os.DirEntry, path: str):
        self._entry, self.name, self.path = entry, entry.name, path

    def __getattr__(self, name):
        return getattr(self._entry, name)

    def __fspath__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"<DirEntry {self.name!r}>"


# --------------------------------------------------------------------------- installing

def passing_folders() -> tuple[str, ...]:
    """Where every rank writes as it is: unique names (the temp folder), the system's, the
    user's caches (written by many processes at once, by design), the launcher's logs."""
    home = os.path.expanduser("~")
    envs = (watchdog.LOG_DIR_ENV, trial.TRIAL_DIR_ENV, *CACHE_ENVS)
    return (tempfile.gettempdir(), "/dev", "/proc", "/sys", "/run", os.path.join(home, ".cache"),
            os.path.join(home, ".triton"), *(os.environ[k] for k in envs if os.environ.get(k)))


def copies_folder() -> str:
    """Where the ranks other than 0 keep their copies: the run's log folder, rank<N> below."""
    logs = os.environ.get(watchdog.LOG_DIR_ENV)
    if logs:
        return os.path.join(logs, "files")
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "run")
    return os.path.join(tempfile.gettempdir(), f"multigpu-files-{run}")


def install(env) -> None:
    """Ranks other than 0: their writes to their own copies. Rank 0: unchanged, but it says where
    those went at its first write."""
    if env.world_size < 2:
        return
    folder, passing = copies_folder(), passing_folders()
    if env.rank == 0:
        return _say_at_first_write(Overlay(folder, passing), folder)
    root = os.path.join(folder, f"rank{env.rank}")
    shutil.rmtree(root, ignore_errors=True)  # an earlier attempt's copies: this rank's own
    os.makedirs(root, exist_ok=True)
    overlay = Overlay(root, passing)
    patch(_patches(overlay))
    _installed["overlay"] = overlay


def patch(replacements: dict) -> None:
    _installed.setdefault("saved", {k: getattr(*k) for k in replacements})
    for (module, name), fn in replacements.items():
        setattr(module, name, fn)


def uninstall() -> None:
    """The real functions back (tests)."""
    for (module, name), fn in _installed.pop("saved", {}).items():
        setattr(module, name, fn)
    _installed.pop("overlay", None)


def forget(path) -> None:
    """On a rank other than 0: `path` is the user's file again for it (rank 0 just wrote it)."""
    overlay = _installed.get("overlay")
    if overlay is not None:
        overlay.forget(path)


def _say_at_first_write(paths: Overlay, folder: str) -> None:
    """One note, at rank 0's first write of a file the other ranks keep to themselves."""
    def open_(file, mode="r", *args, **kwargs):
        if "saved" in _installed and not isinstance(file, int) and \
                any(c in mode for c in "wax+") and paths.key(file) is not None:
            uninstall()
            shown = os.path.relpath(folder) if folder.startswith(os.getcwd()) else folder
            print(f"multigpu: note: --auto: {os.fspath(file)}: the files this script writes are "
                  f"rank 0's; the other ranks write theirs to their own copies, under "
                  f"{shown}{os.sep}rank<N>{os.sep}, and read those back", file=sys.stderr)
        return _real.open(file, mode, *args, **kwargs)

    patch({(builtins, "open"): open_, (io, "open"): open_})
