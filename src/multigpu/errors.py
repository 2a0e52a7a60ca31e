"""User-facing errors.

A `UsageError` is a mistake the user can fix (a bad flag, a missing file, a busy GPU). The CLI prints
it as one line, `multigpu: error: ...`, and exits with status 2, with no traceback unless `--debug`.
Its message says what was passed, why it is wrong, and what to do instead.
"""


class UsageError(ValueError):
    """A mistake in what the user asked for; the message names the fix."""
