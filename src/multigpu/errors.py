"""User-facing errors.

A `UsageError` is a mistake the user can fix (a bad flag, a missing file, a busy GPU). The CLI prints
it as one line, `multigpu: error: ...`, and exits with status 2, with no traceback unless `--debug`.
Its message says what was passed, why it is wrong, and what to do instead.
"""


class UsageError(ValueError):
    """A mistake in what the user asked for; the message names the fix."""


class Stopped(Exception):
    """The run stopped when asked to (a signal, its launcher gone), after saving a checkpoint.
    The CLI prints the message, which names the checkpoint, and exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
