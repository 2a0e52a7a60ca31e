"""A user's script as the launcher starts it: the command that runs it, the file of a module
given as -m, and the --local-rank argument a script of torch.distributed.launch's time parses.
`multigpu run` starts scripts with these, and `multigpu doctor` reads scripts with them.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

from multigpu.core.errors import UsageError

LOCAL_RANK_FLAGS = {"underscore": "--local_rank", "dash": "--local-rank"}


def shebang(data: bytes) -> list[str]:
    """The interpreter and arguments a `#!` first line names; [] without one."""
    first = data.split(b"\n", 1)[0]
    return first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []


def is_python(path: Path, data: bytes) -> bool:
    """Whether a file runs as Python (`multigpu run` starts it through its worker): .py, or
    python in the shebang."""
    return path.suffix == ".py" or any("python" in w for w in shebang(data)[:2])


def script_command(path: Path) -> tuple[list[str], bool]:
    """How to start `path`: (["script.py"], True) for Python, (["bash", "x.sh"], False) for others.

    A file that a shell or the kernel reads (a .sh, a non-Python shebang) must not have CRLF line
    endings: bash fails with "$'\\r': command not found" (trap 9). Python copes with them.
    """
    data = path.read_bytes()
    if is_python(path, data):
        return [str(path)], True
    interpreter = shebang(data)
    if b"\r" in data.split(b"\n", 1)[0] or b"\r\n" in data:
        why = "its shebang names a program that does not exist" if interpreter else "bash fails"
        raise UsageError(f"{path} has Windows (CRLF) line endings, so {why} "
                         f"($'\\r': command not found); convert it with: sed -i 's/\\r$//' {path}")
    return [*(interpreter or ["bash"]), str(path)], False


def module_source(module: str) -> Path | None:
    """The file of `module` without importing it (importing a package runs its __init__ here)."""
    parts = module.split(".")
    for base in [os.getcwd(), *sys.path]:
        root = Path(base or ".", *parts)
        for candidate in (root.with_suffix(".py"), root / "__main__.py"):
            if candidate.is_file():
                return candidate
    if len(parts) == 1:
        spec = importlib.util.find_spec(module)
        if spec and spec.origin and spec.origin.endswith(".py"):
            return Path(spec.origin)
        if spec is None:
            raise _no_module(module)
    # pkg.train: finding the top package imports nothing; a missing one would otherwise start
    # every process only for each to fail on the import
    elif not Path(os.getcwd(), parts[0]).exists() and importlib.util.find_spec(parts[0]) is None:
        raise _no_module(module)
    return None


def _no_module(module: str) -> UsageError:
    return UsageError(f"-m {module}: no module of that name on sys.path (cwd {os.getcwd()}); "
                      "check the name, or run the script by its path")


def detect_local_rank_flag(source: str) -> str:
    """'dash', 'underscore' or 'none': which --local?rank option a script's source parses."""
    dash = re.search(r"""['"]--local-rank['"=]""", source)
    underscore = re.search(r"""['"]--local_rank['"=]""", source)
    if dash:  # also when it takes both spellings: dash is what torch's launcher passes now
        return "dash"
    return "underscore" if underscore else "none"


def local_rank_args(mode: str, source: Path | None) -> list[str]:
    if mode == "auto":
        text = source.read_text(errors="replace") if source and source.is_file() else ""
        mode = detect_local_rank_flag(text)
        if mode != "none":
            print(f"multigpu: {source} parses {LOCAL_RANK_FLAGS[mode]}: passing "
                  f"{LOCAL_RANK_FLAGS[mode]}=<local rank> to each process "
                  "(--local-rank-arg none to stop)", file=sys.stderr)
    if mode == "none":
        return []
    from torch.distributed.elastic.utils import macros  # torchrun fills in ${local_rank}

    return [f"{LOCAL_RANK_FLAGS[mode]}={macros.local_rank}"]
