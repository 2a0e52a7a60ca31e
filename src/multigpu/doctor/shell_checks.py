"""A shell script (or a file given on a command line) read for the traps its lines show:
CRLF line endings (trap 9), the deprecated torch.distributed.launch (trap 15), GPUs chosen by
CUDA_VISIBLE_DEVICES (trap 13). Line regexes only: no shell is parsed or run."""
from __future__ import annotations

import re
from pathlib import Path

from multigpu.core.findings import Finding
from multigpu.launcher.scripts import is_python, shebang  # noqa: F401 (doctor's checks use both)

_SHELL_SUFFIXES = (".sh", ".bash", ".zsh", ".ksh")


def file_crlf_finding(path: Path) -> Finding | None:
    """Trap 9 for a file given on a command line: a shell script with CRLF line endings fails in
    bash; a Python script or a YAML/JSON config reads the same either way (None)."""
    data = path.read_bytes()
    if b"\r\n" not in data or is_python(path, data):
        return None
    if path.suffix in _SHELL_SUFFIXES or not path.suffix or shebang(data):
        return _crlf_finding(path, data)
    return None


# --- shell scripts ------------------------------------------------------------------------------

def _crlf_finding(path: Path, data: bytes) -> Finding:
    line = data[:data.index(b"\r\n")].count(b"\n") + 1
    return Finding("fail", "shell", "Windows (CRLF) line endings: bash stops at the first one "
                   "(syntax error near unexpected token $'\\r'); convert it with: "
                   f"sed -i 's/\\r$//' {path}", trap=9, where=f"{path}:{line}")


def shell_findings(path: Path, data: bytes) -> list[Finding]:
    lines = data.decode(errors="replace").splitlines()
    found = [_crlf_finding(path, data)] if b"\r\n" in data else []
    launch = [i for i, s in enumerate(lines, 1) if re.search(r"-m\s+torch\.distributed\.launch\b", s)]
    if launch:
        found.append(_old_launch_finding(path, launch, lines[launch[0] - 1]))
    cvd = next(((i, m[1]) for i, s in enumerate(lines, 1)
                if (m := re.search(r"\bCUDA_VISIBLE_DEVICES=[\"']?([\w,]*)", s))), None)
    if cvd:
        found.append(Finding("ok", "shell", f"sets CUDA_VISIBLE_DEVICES={cvd[1]}: with multigpu run, "
                             f"--devices {cvd[1] or '0,3'} picks the GPUs (--devices N takes N free "
                             "ones)", trap=13, where=f"{path}:{cvd[0]}"))
    return found


def _old_launch_finding(path: Path, lines: list[int], text: str) -> Finding:
    n = re.search(r"--nproc[_-]per[_-]node[= ](\d+)", text)
    script = re.search(r"(\S+\.py)\b", text)
    more = f" (and {len(lines) - 1} more lines)" if len(lines) > 1 else ""
    fix = f"multigpu run --devices {n[1] if n else 'N'} {script[1] if script else 'script.py'} ..."
    return Finding("warn", "shell", f"starts python -m torch.distributed.launch{more}, deprecated "
                   "(torchrun replaced it: it sets LOCAL_RANK instead of passing --local_rank); fix: "
                   f"{fix} (a free port each time, no --master_port), or torchrun",
                   trap=15, where=f"{path}:{lines[0]}")
