"""What this process, and every process it starts, writes to stdout and stderr for the length of a
block, held back in a file instead of shown; the caller reads it after the block and decides what
to show (doctor --scaling: the bench's progress left out of the report, shown when it failed).
Hazard: process-wide (file descriptors 1 and 2), so only around work that runs on this thread
while nothing else prints."""
from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from contextlib import contextmanager
from collections.abc import Iterator

WARNINGS = ("multigpu: warning:", "multigpu: error:")  # the lines a caller keeps from held output


class Held:
    """The text held back, readable once the block has ended."""

    def __init__(self):
        self.text = ""

    def warnings(self) -> str:
        """The lines of WARNINGS, as they were written."""
        return "".join(line for line in self.text.splitlines(keepends=True) if line.startswith(WARNINGS))


@contextmanager
def held_output() -> Iterator[Held]:
    held = Held()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    with tempfile.TemporaryFile() as file:
        # appended to: the processes started meanwhile share the file's offset with this one
        fcntl.fcntl(file.fileno(), fcntl.F_SETFL, fcntl.fcntl(file.fileno(), fcntl.F_GETFL) | os.O_APPEND)
        saved = os.dup(1), os.dup(2)
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        # print() too, where sys.stdout is not file descriptor 1 (pytest's capture, a wrapper)
        streams = sys.stdout, sys.stderr
        text = open(file.fileno(), "w", buffering=1, errors="backslashreplace", closefd=False)
        sys.stdout = sys.stderr = text
        try:
            yield held
        finally:
            text.close()  # flushed; the file stays open (closefd=False)
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            file.seek(0)
            held.text = file.read().decode(errors="replace")
