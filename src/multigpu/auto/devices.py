"""Each process sees only its own GPU, so that the GPU code of a one-device script needs no edit.

`.cuda()`, `.to("cuda")`, `"cuda:0"`, `torch.device("cuda")` all mean the first visible GPU; with
CUDA_VISIBLE_DEVICES narrowed to the process's own GPU, that is its own, and a script's own
`nn.DataParallel` spans that one GPU (it then calls the model directly). CUDA reads the variable
when it initialises, so this runs before the worker (or the script) touches CUDA.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

from multigpu.core.errors import UsageError


def narrow_to_own_gpu(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set CUDA_VISIBLE_DEVICES to this process's own GPU, the LOCAL_RANK-th of those its launcher
    left visible (all of them when it named none). Returns that GPU's id, or None for a CPU
    process (the launcher hid every GPU: CUDA_VISIBLE_DEVICES="")."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() == "":
        return None
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    ids = [v.strip() for v in visible.split(",")] if visible is not None else None
    if ids is None:
        own = str(local_rank)
    elif local_rank < len(ids):
        own = ids[local_rank]
    else:
        raise UsageError(f"process {local_rank} on this machine has no GPU of its own: "
                         f"CUDA_VISIBLE_DEVICES={visible} names {len(ids)}; start one process "
                         f"per GPU, e.g. multigpu run --auto --devices {len(ids)}")
    environ["CUDA_VISIBLE_DEVICES"] = own
    return own
