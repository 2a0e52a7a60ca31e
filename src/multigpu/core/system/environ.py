"""Environment variables set for the length of a block, then put back as they were (a variable
that was unset is unset again): for what reads them from a process started inside the block."""
from __future__ import annotations

import os
from contextlib import contextmanager
from collections.abc import Iterator, Mapping


@contextmanager
def environ_set(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
