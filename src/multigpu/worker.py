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
    store = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))  # before the script
    try:
        _run(argv)
    except SystemExit as exc:
        if exc.code in (None, 0):
            _finish_group(*store)
        raise
    _finish_group(*store)


def _finish_group(addr: str | None, port: str | None) -> None:
    """A script that ends with its process group alive (most do: destroy_process_group is easy to
    forget) leaves the group to the interpreter's exit, where gloo can abort while a peer is still
    finishing ("terminate called without an active exception"): a finished rank reported as
    failed. Done here instead, as multigpu's own runs do it: the ranks meet, then tear down."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    from multigpu.distributed import destroy_distributed

    destroy_distributed(wait_for_peers=True, store=(addr, port))


def _run(argv: list[str]) -> None:
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
