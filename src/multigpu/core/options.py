"""What a component's configuration is made of: fields that carry their own help text and limits,
and the one check of those limits, said in the library's words.

Each component (the strategy's options, precision, logging; the train application's data,
checkpointing and optimisation) is a small dataclass of `option()` fields, defined beside the
module that uses it and checked when it is made, so a mistake is refused where the value is
defined, for a library caller and for `multigpu train` alike. The command line builds its flags
from the same fields (train/settings/config.py) and says these errors with its flags (train/settings/flagwords.py).
Importing it does not import torch: the CLI checks its flags before that slow import.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields

from multigpu.core.errors import Api, Text, UsageError


@dataclass(frozen=True)
class Flag:
    """How an option reads as a command-line flag, beyond its name: `metavar`, the word its usage
    shows for the value; `const`, what the flag means given alone (None: it takes a value)."""
    metavar: str | None = None
    const: object = None


def option(default=MISSING, help: str = "", *, choices=None, flag: Flag = Flag(),
           at_least=None, above=None, example=None):
    """A field with its help text. `choices`: the values it takes. `flag`: its spelling as a
    command-line flag (Flag). `at_least` / `above`: the smallest number it takes (that number
    itself allowed, or not); any number must also be finite. `example`: the value the refusal
    suggests (default: the bound, at least 1)."""
    return field(default=default, metadata={
        "help": help, "choices": choices, "metavar": flag.metavar, "const": flag.const,
        "low": above if at_least is None else at_least, "inclusive": at_least is not None,
        "example": example})


def check_options(config) -> None:
    """Refuse a value of `config` (a dataclass of `option()` fields) outside its field's choices
    or limits, naming the field as `Type(field=value)`: a UsageError of one line."""
    owner = type(config).__name__
    for f in fields(config):
        value, meta = getattr(config, f.name), f.metadata
        choices = meta.get("choices")
        if choices is not None and value is not None and value not in choices:
            raise UsageError(Text(f"{{}} is not one of {', '.join(map(str, choices))}",
                                  _api(owner, f.name, value)))
        if meta.get("low") is not None:
            _check_number(owner, f.name, value, meta)


def _check_number(owner: str, name: str, value, meta) -> None:
    low, inclusive = meta["low"], meta["inclusive"]
    if value is None or value == "auto":  # optional and left out; a batch size found by steps
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and (value > low or (value == low and inclusive)):
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UsageError(Text("{} is not a number", _api(owner, name, value)))
    bound = f"at least {low}" if inclusive else f"more than {low}"
    example = meta["example"] if meta["example"] is not None else max(low, 1)
    raise UsageError(Text(f"{{}} must be a number {bound}, e.g. {{}}",
                          _api(owner, name, value, shown=f"{value:g}"),
                          _api(owner, name, example)))


def _api(owner: str, name: str, value, shown=None) -> Api:
    """`owner(name=value)` in the library's words; as a flag, `shown` (the value as written)."""
    return Api(f"{owner}.{name}", value if shown is None else shown,
               text=f"{owner}({name}={value!r})")
