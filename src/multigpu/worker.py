"""What `multigpu run` starts on every device: the watchdog, then the user's script, unchanged.

    python -P -m multigpu.worker script.py ARGS...     (python -P -m multigpu.worker -m pkg.mod ARGS...)

The script runs as `python script.py ARGS` would run it: `__name__ == "__main__"`, `sys.argv`,
the script's folder first on sys.path (the current folder for -m), its exceptions and exit status.
`-P` keeps the current folder off sys.path while multigpu itself is imported, so a file named
multigpu.py beside the user's script (pytorch/examples has one) cannot shadow this package.
"""
from __future__ import annotations

import os
import runpy
import sys

from multigpu import watchdog


def main(argv: list[str]) -> None:
    watchdog.start_from_env()
    if argv[:1] == ["-m"]:
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]  # runpy puts the module's path in argv[0]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, args = argv[0], argv[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
