"""A run's folder: claimed without races, never someone else's, and its metrics kept consistent.

    runs/<time>-<model>-<data>/
        config.json      the resolved settings and provenance (first a claim: created
                         exclusively, so two runs started at the same moment never share a
                         folder); `--config` takes it back to repeat the run (configfile.py)
        metrics.jsonl    one line per finished epoch
        metrics.csv      the same records as a table (with --logger csv, the default)
        steps.csv, tensorboard/, curves.png   see runlog.py
        checkpoints/     see checkpoint_store
        logs/            each rank's output, with several processes

A folder that holds anything is only ever used again to continue the run in it (--resume), with
one exception: a folder in which nothing was trained (nothing_trained: a launch killed or stopped
during start-up) and which no live process uses (folder_users) is taken again by the next run; the
earlier launch's logs stay in it (each launch logs into a folder of its own under logs/).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from multigpu.core.checkpoints import checkpoint_schema as schema
from multigpu.train.rundir import folder_users
from multigpu.core import console
from multigpu.core.system import fileio, orphans
from multigpu.core.errors import UsageError
from multigpu.train.rundir.folder_users import OUT_RESERVED_ENV

if TYPE_CHECKING:
    from multigpu.train.settings.config import TrainConfig

CONFIG, METRICS, METRICS_CSV, LOGS = "config.json", "metrics.jsonl", "metrics.csv", "logs"
_CLAIM = b'{"status": "starting"}\n'


def default_out(model: str, data: str) -> Path:
    """runs/<time>-<model>-<data kind>: one folder right under runs/, whatever the names hold (a
    path given as the data spec, a hub model's org/name): characters other than letters, digits,
    `_`, `.` and `-` become `-`, and a part left empty or of dots only (`.`, `..`) is `data`."""
    import re

    def part(text: str, empty: str) -> str:
        text = re.sub(r"[^\w.-]", "-", text).strip(".-")
        return text or empty
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{part(model, 'model')}-{part(data.split(':', 1)[0], 'data')}"


def out_for(cfg: TrainConfig) -> str | None:
    """The run folder `cfg` names, or None for a new one under runs/: --out, else with --resume
    the resumed run's folder (a lone checkpoint file starts a new one)."""
    out = cfg.out
    if cfg.checkpointing.resume and not out:
        path = Path(cfg.checkpointing.resume)
        if path.is_file():  # a checkpoint inside a run folder goes on there, any other: a new one
            path = schema.run_folder_of(path)
            out = str(path) if is_run_folder(path) else None
        elif path.is_dir():
            out = str(path)
        else:
            raise missing_resume(cfg.checkpointing.resume)
    return out


def reserve_out(cfg: TrainConfig, nodes_log: bool = False) -> Path:
    """The run folder of `cfg` (out_for), claimed for this run (reserve). Torch-free: the
    launching process claims the folder before it starts the workers."""
    return reserve(out_for(cfg), model=cfg.model, data=cfg.input.data, continuing=bool(cfg.checkpointing.resume),
                   nodes_log=nodes_log)


def missing_resume(resume: str, flag: str = "--resume") -> UsageError:
    return UsageError(f"{flag} {resume}: no checkpoint there (no such file or folder); give a "
                      "checkpoint file or a run folder")


def reserve(out: str | None, *, model: str, data: str, continuing: bool, nodes_log: bool = False) -> Path:
    """The run folder, claimed for this run. `continuing`: --resume was given, so an existing
    run folder (the one resumed, or this command's own from an earlier attempt) is taken as is.
    `nodes_log`: node 0 of several: the other nodes may already have made LOGS in the folder on
    a shared filesystem (they start their launchers without waiting for this claim)."""
    if out is None:
        base = default_out(model, data)
        for n in range(1, 1000):  # runs started in the same second get -2, -3, ...
            candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
            if _claim(candidate, fresh_only=True):
                folder_users.hold(candidate)
                return candidate
        raise UsageError(f"could not claim a new folder next to {base}; pass --out")
    path = Path(out)
    if os.environ.get(OUT_RESERVED_ENV) == str(path.resolve()):
        return path  # a worker of a launch whose parent claimed it
    continuing = continuing and is_run_folder(path)
    if not continuing and path.exists() and not path.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder for the run")
    for attempt in (1, 2):
        with folder_users.claiming(path):
            if (folder_users.in_use(path) is not True if continuing else
                    _claim(path, fresh_only=False, allowed={LOGS} if nodes_log else set()) or _take(path)):
                folder_users.hold(path)  # inside the claim: the next claimer sees it in use
                return path
        if attempt == 2 or not (continuing or untrained_run_folder(path)):
            break
        _wait_for_stopping_workers(path, out)  # or a one-line refusal
    if continuing:
        raise UsageError(f"--out {out} is used by another run; choose another --out, or stop that "
                         "run first")
    if untrained_run_folder(path) and folder_users.in_use(path) is None:
        raise UsageError(f"--out {out}: nothing was trained in it, but whether a run still uses it "
                         "cannot be told here (this filesystem has no file locks): if none does, "
                         "remove it; or choose another --out")
    raise UsageError(f"--out {out} already exists and is not empty; multigpu never overwrites "
                     "a run: choose another --out, or leave it out for a new timestamped folder "
                     + _what_is_there(path, out))


def _what_is_there(path: Path, out: str) -> str:
    """The end of the refusal: --resume continues a run, but only misleads for a folder of the
    user's own files (it holds no checkpoint)."""
    if is_run_folder(path):
        return "(to continue that run, add --resume)"
    names = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"({out} is no run folder: it holds {shown}, left as they are)"


def untrained_run_folder(path: Path) -> bool:
    """A run folder multigpu made in which nothing was trained (nothing_trained): its config.json
    is the claim or a config multigpu wrote, not a file of the user's own."""
    return _written_by_us(path / CONFIG) and nothing_trained(path, logs=True)


def _written_by_us(config: Path) -> bool:
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and (data == json.loads(_CLAIM) or "provenance" in data and "model" in data)


def _take(path: Path) -> bool:
    """Take again a folder in which nothing was trained (a launch killed or stopped during
    start-up) when no live process uses it; whether it was taken. Its claim is written anew; the
    earlier launch's logs stay (under logs/, in a folder of that launch's own)."""
    if not untrained_run_folder(path) or folder_users.in_use(path) is not False:
        return False
    fileio.atomic_write_text(path / CONFIG, _CLAIM.decode())
    return True


def _wait_for_stopping_workers(path: Path, out: str) -> None:
    """Return once no process holds `path`, when only workers whose launcher died hold it
    (orphans.py: they stop within orphans.GRACE_SECONDS), saying so; else a one-line refusal."""
    pids = folder_users.holders(path)
    named = ", ".join(map(str, pids))
    if not folder_users.orphaned_workers(pids):
        if folder_users.in_use(path) is not True:
            return  # gone meanwhile (or not known: the caller refuses)
        raise UsageError(f"--out {out} is used by a run starting or running now"
                         + (f" (pid {named})" if pids else "") + "; choose another --out, or stop "
                         "that run first")
    wait = orphans.GRACE_SECONDS + 5
    console.info(f"multigpu train: --out {out} is still held by the stopping workers of an earlier "
                 f"launch whose launcher is gone (pid {named}); waiting up to {wait:.0f} s for them")
    deadline = time.monotonic() + wait
    while folder_users.in_use(path) is True:
        if time.monotonic() > deadline:
            raise UsageError(f"--out {out}: the workers of an earlier launch (pid {named}) still "
                             f"hold it after {wait:.0f} s; end them (kill {named.replace(',', '')}) "
                             "or choose another --out")
        time.sleep(0.1)


def is_run_folder(path: Path) -> bool:
    return (path / CONFIG).is_file() or schema.checkpoints_folder(path).is_dir()


def _claim(path: Path, fresh_only: bool, allowed: set[str] = frozenset()) -> bool:
    """Create `path` (or take it empty but for `allowed` names) with an exclusively created
    config.json: exactly one of several runs racing for the same folder gets True."""
    try:
        path.mkdir(parents=True)
    except FileExistsError:
        if fresh_only or not path.is_dir():
            return False
    try:
        fd = os.open(path / CONFIG, os.O_CREAT | os.O_EXCL | os.O_WRONLY, fileio.FILE_MODE)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(_CLAIM)
    if any(p.name != CONFIG and p.name not in allowed for p in path.iterdir()):  # not ours
        (path / CONFIG).unlink()
        return False
    return True


def nothing_trained(path: Path, logs: bool = False) -> bool:
    """True while the folder holds only what a run writes before its first epoch ends: its
    config.json and a checkpoints/ folder with no checkpoint in it (nothing worth keeping);
    `logs`: and the ranks' LOGS of that launch."""
    if not path.is_dir():
        return False
    for entry in path.iterdir():
        if entry.name == schema.CHECKPOINTS and entry.is_dir():
            if any(not p.name.startswith(".") for p in entry.iterdir()):
                return False
        elif not (entry.name == CONFIG or (logs and entry.name == LOGS and entry.is_dir())):
            return False
    return True


def finished_checkpoint(path: Path, epochs: int) -> tuple[Path, int] | None:
    """(the newest complete checkpoint, the epochs it trained) of a run that trained all its
    `epochs` (the checkpoint records the run past its last epoch); None while any epoch is left,
    or when the folder's checkpoints cannot be read."""
    from multigpu.train.checkpoints.checkpoint_store import CheckpointStore

    store = CheckpointStore(schema.checkpoints_folder(path))
    try:
        entries = store.entries() if store.folder.is_dir() else []
    except UsageError:  # a damaged manifest (CheckpointError): not known to be finished
        return None
    done = schema.completed_epochs(entries[-1].run) if entries else None
    if done is not None and done >= epochs:
        return store.folder / entries[-1].file, done
    return None


def remove_untrained(path: Path, up_to: Path, keep: bool = False) -> None:
    """Remove a folder for which nothing_trained() holds, and the empty folders above it that
    this run made (up to `up_to`, the outermost one); `keep`: only what the run wrote in it (a
    folder the user made stays, empty, as it was)."""
    checkpoints = schema.checkpoints_folder(path)
    if checkpoints.is_dir():
        for p in checkpoints.iterdir():  # hidden: a lock, a save's temporary file or shard folder
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        checkpoints.rmdir()
    if (path / LOGS).is_dir():  # nothing_trained(logs=True): the logs of a launch that failed
        shutil.rmtree(path / LOGS)
    (path / CONFIG).unlink(missing_ok=True)
    if keep:
        return
    path = path.absolute()
    path.rmdir()
    up_to = up_to.absolute()
    while path != up_to and up_to in path.parents and not any(path.parent.iterdir()):
        path = path.parent
        path.rmdir()


def write_config(out: Path, resolved: dict) -> None:
    fileio.atomic_write_text(out / CONFIG, json.dumps(resolved, indent=2) + "\n")


def trained_batch_size(out: Path, resume: str | None) -> int | None:
    """The per-device batch a run continued here trained with (config.json of the folder that
    holds its checkpoints: `out`, else the folder of --resume), or None for a new run."""
    folders = [out]
    if resume:
        source = Path(resume)
        folders.append(schema.run_folder_of(source) if source.is_file() else schema.run_folder(source))
    for folder in folders:
        checkpoints = schema.checkpoints_folder(folder)
        if not checkpoints.is_dir() or not any(checkpoints.glob("*.pt")):
            continue
        try:
            size = json.loads((folder / CONFIG).read_text()).get("batch_size")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(size, int) and size > 0:
            return size
    return None


def append_metrics(out: Path, record: dict) -> None:
    with open(out / METRICS, "a") as f:
        f.write(json.dumps(record) + "\n")


def reconcile_metrics(out: Path, completed_epochs: int, last_record: dict | None) -> None:
    """After a resume in the same folder: one line per epoch up to the checkpoint's, none after.

    A line can be missing (a crash between the checkpoint and its line; the checkpoint keeps the
    epoch's record, so it is written back), torn (a crash mid-line: dropped), or ahead of the
    checkpoint (resumed from an older checkpoint because the newest was damaged: dropped, the
    epoch is trained again)."""
    path = out / METRICS
    records = {}
    for record in read_metrics(out):
        try:
            epoch = int(record["epoch"])
        except (ValueError, KeyError, TypeError):
            continue
        if epoch <= completed_epochs:
            records[epoch] = record
    # Only a folder whose lines start at epoch 1 or go on to the checkpoint's epoch gets it back:
    # a run resumed into a new folder logs the epochs trained there, not the one before them.
    if last_record and last_record.get("epoch") == completed_epochs and (records or completed_epochs == 1):
        records.setdefault(completed_epochs, last_record)
    text = "".join(json.dumps(records[e]) + "\n" for e in sorted(records))
    if path.is_file() or text:
        fileio.atomic_write_text(path, text)


def read_metrics(out: Path) -> list[dict]:
    """The epochs' records of metrics.jsonl (a line torn by a crash is left out)."""
    records = []
    path = out / METRICS
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def write_metrics_csv(out: Path) -> None:
    """metrics.csv: metrics.jsonl as a table, one row per epoch, every key a column (written
    whole from the JSON lines, so the two files always agree; table_row says how a list is)."""
    records = [table_row(r) for r in read_metrics(out)]
    fileio.atomic_write_csv(out / METRICS_CSV, list(dict.fromkeys(k for r in records for k in r)), records)


def table_row(record: dict) -> dict:
    """A metrics.jsonl record as a row of plain values: each rank's figures (`ranks`, a list of
    dicts) as columns rank<N>_<figure> of its numbers; any other list or dict left to the JSON."""
    row = {}
    for key, value in record.items():
        if key == "ranks" and isinstance(value, list):
            row |= {f"rank{r.get('rank', i)}_{k}": v for i, r in enumerate(value)
                    for k, v in r.items() if k != "rank" and isinstance(v, (int, float))}
        elif not isinstance(value, (list, dict)):
            row[key] = value
    return row
