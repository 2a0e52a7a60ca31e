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

Caught: what goes through Python's file functions: open (io.open, pathlib, numpy, PIL, matplotlib,
torchvision, gzip, zipfile, tarfile, logging and shutil use it), os.open, os.stat and os.lstat
(os.path.exists, isdir...), os.mkdir (os.makedirs), os.rmdir, os.remove/unlink, os.rename/replace
(shutil.move), os.listdir, os.scandir (glob, os.walk), os.chmod, os.chown and os.utime
(shutil.copy's, tarfile's), shutil.rmtree; safetensors' save_file, load_file and safe_open (written
in Rust). Passing untouched: file descriptors, the system temp folder (tempfile's unique names,
torch's compile caches, which compilers and imports read by name), /dev /proc /sys /run, the user's
caches (~/.cache, TORCH_HOME, HF_HOME...), the launcher's log folder. Not caught
(docs/launching.md): writes from C extensions (cv2.imwrite, h5py), from programs the script starts,
from loader workers started by spawn or forkserver (they see the user's files); os.chdir into a
folder only the rank made; sockets; a run per rank of an online logger (wandb).

Cheap on purpose: until a rank writes, a read is one test; after, one dict lookup per path (and
a walk up its folders only below a folder the rank deleted): 4-5 us here, less than os.stat.
"""
from __future__ import annotations

import builtins
import errno
import importlib.util
import io
import os
import shutil
import sys
import tarfile
import tempfile

from multigpu.auto.writes.overlay import GONE, OPAQUE, OWN, Overlay, error, kind_of, real
from multigpu.launcher import leases
from multigpu.launcher.rank import trial, watchdog

CACHE_ENVS = ("XDG_CACHE_HOME", "TORCH_HOME", "HF_HOME", "TRITON_CACHE_DIR",
              "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_installed: dict = {}  # "overlay": this rank's Overlay, "saved": what the patches replaced


def _rename(ov: Overlay, fn, src, dst, *, src_dir_fd=None, dst_dir_fd=None):
    """os.rename/os.replace on a rank other than 0: the rank's own copy of `src` moves to its
    copy of `dst`; the user's `src`, where that is what it saw, is hidden from it, not moved."""
    relative = src_dir_fd is not None or dst_dir_fd is not None  # to folders' fds: as they are
    ks, kd = (None, None) if relative else (ov.key(src), ov.key(dst))
    if ks is None and kd is None:
        return fn(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    source = ov.materialize(ks, src) if ks else src
    folder = kind_of(source) == "dir"
    target = ov.for_write(kd, dst, copy_up=False) if kd else dst
    shutil.move(source, target)  # a copy and a passing path can be on different filesystems
    if ks:
        ov.record(ks, GONE, folder=folder)
    if kd:
        ov.record(kd, OPAQUE if folder else OWN, folder=folder)


def _delete(ov: Overlay, fn, want: str):
    """os.remove/unlink (want "file") or os.rmdir ("dir"): the rank's copy goes, and the user's
    file is hidden from the rank, never removed."""
    def delete(path, *, dir_fd=None):
        key = ov.key(path) if dir_fd is None else None
        if key is None:
            return fn(path, dir_fd=dir_fd)
        kind = ov.kind(key)
        if kind is None:
            raise error(FileNotFoundError, errno.ENOENT, path)
        if kind != want:
            raise (error(IsADirectoryError, errno.EISDIR, path) if want == "file" else
                   error(NotADirectoryError, errno.ENOTDIR, path))
        if want == "dir":
            names = ov.listing(key, path)
            if names or (names is None and real.listdir(key)):
                raise error(OSError, errno.ENOTEMPTY, path)
        if ov.seen(key) == OWN:
            (real.rmtree if want == "dir" else real.unlink)(ov.copy_of(key))
        ov.record(key, GONE, folder=want == "dir")
    return delete


def _patches(ov: Overlay) -> dict[tuple[object, str], object]:
    """(module, name) -> what a rank other than 0 calls there instead."""
    open_, reading = _open(ov), _reading(ov)

    def renaming(fn):
        return lambda src, dst, **fds: _rename(ov, fn, src, dst, **fds)

    return {
        (builtins, "open"): open_, (io, "open"): open_, (tarfile, "bltn_open"): open_,
        (os, "open"): _os_open(ov), (os, "stat"): reading(real.stat),
        (os, "lstat"): reading(real.lstat), (os, "chmod"): reading(real.chmod),
        (os, "utime"): reading(real.utime), (os, "chown"): reading(real.chown),
        (os, "lchown"): reading(real.lchown), (os, "mkdir"): _mkdir(ov),
        (os, "rmdir"): _delete(ov, real.rmdir, "dir"),
        (os, "remove"): _delete(ov, real.remove, "file"),
        (os, "unlink"): _delete(ov, real.unlink, "file"),
        (os, "rename"): renaming(real.rename), (os, "replace"): renaming(real.replace),
        (os, "listdir"): _listdir(ov), (os, "scandir"): _scandir(ov), (shutil, "rmtree"): _rmtree(ov),
        **_safetensors(ov),
    }


def _open(ov: Overlay):
    """open (builtins, io, tarfile's): a write goes to the rank's copy, a read to what it sees."""
    def open_(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None,
              closefd=True, opener=None):
        opened = []

        def do(where):
            opened.append(where)
            return real.open(where, mode, buffering, encoding, errors, newline, closefd, opener)
        if isinstance(file, int) or opener is not None:  # an opener opens what it wants
            return do(file)  # (tempfile's opens a new name, through os.open: tracked there)
        if any(c in mode for c in "wax+"):
            f = ov.write(file, do, copy_up="a" in mode or ("+" in mode and "r" in mode))
        else:
            f = do(ov.for_read(file))
        if opened[0] is not file:  # the script's f.name: the path it opened, as without --auto
            raw = getattr(f, "buffer", f)
            getattr(raw, "raw", raw).name = os.fspath(file)
        return f
    return open_


def _os_open(ov: Overlay):
    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is not None:
            return real.os_open(path, flags, mode, dir_fd=dir_fd)
        if flags & _WRITE_FLAGS:
            return ov.write(path, lambda where: real.os_open(where, flags, mode),
                            copy_up=not flags & os.O_TRUNC)
        return real.os_open(ov.for_read(path), flags, mode)
    return os_open


def _reading(ov: Overlay):
    """A function of a path that only reads it (os.stat, os.chmod...): given what the rank sees."""
    def reading(fn):
        def call(path, *args, dir_fd=None, **kwargs):
            if dir_fd is not None:
                return fn(path, *args, dir_fd=dir_fd, **kwargs)
            return fn(ov.for_read(path), *args, **kwargs)
        return call
    return reading


def _mkdir(ov: Overlay):
    def mkdir(path, mode=0o777, *, dir_fd=None):
        key = ov.key(path) if dir_fd is None else None
        if key is None:
            return real.mkdir(path, mode, dir_fd=dir_fd)
        seen = ov.seen(key)
        # A folder rank 0 has just made is taken as this rank's own, as the one process would
        # have made it itself: `if not os.path.exists(d): os.makedirs(d)` races between ranks.
        if seen == OWN or (seen is None and kind_of(key) == "file"):
            raise error(FileExistsError, errno.EEXIST, path)
        if ov.kind(os.path.dirname(key)) != "dir":
            raise error(FileNotFoundError, errno.ENOENT, path)
        os.makedirs(ov.copy_of(key), mode, exist_ok=True)
        ov.record(key, OPAQUE if seen == GONE else OWN, folder=True)
    return mkdir


def _rmtree(ov: Overlay):
    """shutil.rmtree: the rank's copies go, the user's folder is hidden from the rank."""
    def rmtree(path, ignore_errors=False, *args, **kwargs):
        key = ov.key(path) if kwargs.get("dir_fd") is None else None
        if key is None:
            return real.rmtree(path, ignore_errors, *args, **kwargs)
        kind = ov.kind(key)
        if kind != "dir":
            if ignore_errors:
                return None
            raise (error(FileNotFoundError, errno.ENOENT, path) if kind is None else
                   error(NotADirectoryError, errno.ENOTDIR, path))
        if ov.seen(key) == OWN:
            real.rmtree(ov.copy_of(key), ignore_errors=True)
        ov.record(key, GONE, folder=True)
    return rmtree


def _listdir(ov: Overlay):
    def listdir(path="."):
        key = ov.key(path)
        names = None if key is None else ov.listing(key, path)
        if names is None:
            return real.listdir(path)
        return [os.fsencode(n) for n in names] if isinstance(path, bytes) else names
    return listdir


def _scandir(ov: Overlay):
    def scandir(path="."):
        key = ov.key(path)
        names = None if key is None else ov.listing(key, path)
        return real.scandir(path) if names is None else _Scan(ov, os.fsdecode(path), key, names)
    return scandir


def _safetensors(ov: Overlay) -> dict[tuple[object, str], object]:
    """safetensors, where it is installed, writes and reads its files in Rust, past the patches
    above (save_pretrained's default format): its file functions given the rank's own paths."""
    if importlib.util.find_spec("safetensors") is None:
        return {}
    import safetensors
    import safetensors.torch as st

    save_file, load_file, safe_open = st.save_file, st.load_file, safetensors.safe_open

    def save_file_(tensors, filename, metadata=None):
        return ov.write(filename, lambda where: save_file(tensors, where, metadata))

    def load_file_(filename, *args, **kwargs):
        return load_file(ov.for_read(filename), *args, **kwargs)

    def safe_open_(filename, *args, **kwargs):
        return safe_open(ov.for_read(filename), *args, **kwargs)

    return {(st, "save_file"): save_file_, (st, "load_file"): load_file_,
            (st, "safe_open"): safe_open_, (safetensors, "safe_open"): safe_open_}


class _Scan:
    """os.scandir of a folder this rank changed: the user's entries it still sees, and its own
    (their `path` under the folder the script named, as os.scandir gives it)."""

    def __init__(self, ov: Overlay, path, key: str, names: list[str]):
        own, users = {}, {}
        if kind_of(ov.copy_of(key)) == "dir":  # the rank's copies of what it wrote here
            with real.scandir(ov.copy_of(key)) as it:
                own = {e.name: e for e in it}
        if ov.merged(key) and kind_of(key) == "dir":
            with real.scandir(path) as it:
                users = {e.name: e for e in it}
        entries = [_Entry(own[n], os.path.join(os.fspath(path), n))
                   if n in own and ov.seen(os.path.join(key, n)) == OWN else users.get(n)
                   for n in names]
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
    envs = (watchdog.LOG_DIR_ENV, trial.TRIAL_DIR_ENV, leases.LEASE_DIR_ENV, *CACHE_ENVS)
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
                kwargs.get("opener") is None and any(c in mode for c in "wax+") and \
                paths.key(file) is not None:
            uninstall()
            shown = os.path.relpath(folder) if folder.startswith(os.getcwd()) else folder
            print(f"multigpu: note: --auto: {os.fsdecode(file)}: the files this script writes are "
                  f"rank 0's; the other ranks write theirs to their own copies, under "
                  f"{shown}{os.sep}rank<N>{os.sep}, and read those back", file=sys.stderr)
        return real.open(file, mode, *args, **kwargs)

    patch({(builtins, "open"): open_, (io, "open"): open_})
