"""What --auto cannot make data-parallel is refused in one line, when the script does it.

A script that forms its own process group is distributed already: --auto would form a second
one around it. The refusal names the command that runs such a script as it is.
"""
from __future__ import annotations

import functools
import os
import sys

from multigpu.core.errors import UsageError



def already_distributed(script: str) -> str:
    return (f"{script} calls torch.distributed.init_process_group itself, so it is distributed "
            f"already and --auto would split it a second time; run it with `multigpu run "
            f"{script}` (without --auto)")


def install() -> None:
    """init_process_group raises a UsageError from now on (the worker formed its group before)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        raise UsageError(already_distributed(os.path.basename(sys.argv[0]) or "the script"))

    dist.init_process_group = init_process_group
    distributed_c10d.init_process_group = init_process_group
