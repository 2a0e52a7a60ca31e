"""User-facing errors.

A `UsageError` is a mistake the user can fix (a bad flag, a missing file, a busy GPU). The CLI prints
it as one line, `multigpu: error: ...`, and exits with status 2, with no traceback unless `--debug`.
Its message says what was passed, why it is wrong, and what to do instead.

The library's messages name its own API (`setup(strategy='ddp')`), as a library caller writes it.
The same mistakes reach users of `multigpu train`, who know flags (`--strategy ddp`): such a
message is a `Text`, which keeps the API names it used (`Api`) apart from the words around them,
and the CLI says it again with its flags (flagwords.py). The library never names a flag.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Api:
    """A name of the library's API in a message: `name` ("setup.strategy", "DDPOptions.static_graph"),
    the `value` to pass (none: the name alone), and `text`, the library's words for it where
    `call(arg=value)` would not read well."""
    name: str
    value: object = ...  # Ellipsis: no value (a singleton, so it survives pickling)
    text: str | None = None

    @property
    def has_value(self) -> bool:
        return self.value is not ...

    def __str__(self) -> str:
        if self.text is not None:
            return self.text
        call, _, arg = self.name.partition(".")
        return f"{call}({arg}={self.value!r})" if self.has_value else f"{call}({arg}=...)"


class Text(str):
    """A message in the library's words that keeps its template and the `Api` names it used, so
    that a CLI can say it with its flags: `Text("use {}", Api("setup.strategy", "ddp"))` is the str
    "use setup(strategy='ddp')"; `template` is "use {}", `names` the Api. A plain str otherwise
    (it pickles, compares and prints as one)."""

    template: str
    names: tuple[Api, ...]

    def __new__(cls, template: str, *names: Api) -> Text:
        self = super().__new__(cls, template.format(*names) if names else template)
        self.template, self.names = template, names
        return self

    def __getnewargs__(self):  # unpickled (a rank's error sent to the others) with its names
        return (self.template, *self.names)

    def say(self, word) -> str:
        """The message with each Api said as `word(api)` (a CLI's flag for it) instead."""
        return self.template.format(*map(word, self.names)) if self.names else str(self)


class UsageError(ValueError):
    """A mistake in what the user asked for; the message names the fix."""


class Stopped(Exception):
    """The run stopped when asked to (a signal, its launcher gone), after saving a checkpoint.
    The CLI prints the message, which names the checkpoint, and exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def os_error_text(exc: OSError) -> str:
    """What an OSError says, with the file it names where it names one: a failed write (a full
    disk, a file size limit) carries no file name, and "(None)" tells the user nothing."""
    what = exc.strerror or str(exc)
    return f"{what} ({exc.filename})" if exc.filename is not None else what
