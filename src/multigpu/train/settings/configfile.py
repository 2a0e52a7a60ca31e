"""`multigpu train --config FILE`: a YAML or JSON file whose keys are the command's flags.

    model: resnet50              # any flag, as batch_size or batch-size
    data: folder:./imgs
    batch-size: 128
    compile: true                # a flag that may stand alone (--compile) takes true

The file is read before the command line: its values become the parser's defaults, so every flag
given on the command line wins, and a required flag (--model) may come from the file. A run's own
config.json is such a file too (a run is repeated with `--config runs/X/config.json`): its facts
about the run (world size, dataset sizes, provenance) are skipped, and so are its `out` and
`resume`, so that the new run never writes into the old run's folder.
Every mistake in the file is one line naming the file and the key, before anything else happens.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

from multigpu.core.errors import UsageError

FLAG = "--config"
# Keys of a run's config.json that are facts about that run, not flags (training.resolved_config).
RUN_FACTS = ("world_size", "global_batch", "train_size", "val_size", "task", "provenance",
             "input_shape", "num_outputs", "plan", "micro_batch", "accumulation")  # the last: global_batch.FACTS
# Not carried over from a run's config.json: its folder is that run's, not the new one's.
NOT_REPEATED = ("out", "resume")
_NOT_SETTINGS = ("help", "debug", "config")


def read_config_first(parser: argparse.ArgumentParser, on_note=print) -> None:
    """Make `parser` read `--config FILE` before its other arguments. argparse has no hook
    between reading the arguments and applying the defaults, so this wraps the parser's own
    parse_known_args (which its subcommand parser calls too); `on_note` gets the info line said
    when a run's config.json leaves out its folder. A bad file exits with one line, status 2.
    The arguments as typed are kept as `command_line` (the run's provenance: workers are started
    with other arguments)."""
    parse_known_args = parser.parse_known_args

    def parse_first(args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        typed = _abbreviated(args)
        if typed:  # said before argparse's "required: --model", which the file would have given
            parser.exit(2, f"multigpu: error: {parser.prog} has no option {typed}; did you mean "
                           f"{FLAG}?\n")
        path = config_path(args)
        if path is not None:
            try:
                values, note = load(path, _settable(parser))
            except UsageError as exc:
                parser.exit(2, f"multigpu: error: {exc}\n")
            if note:
                on_note(note)
            parser.set_defaults(**values)
            # a flag the file gives is no longer required (argparse has no public accessor)
            for action in parser._actions:
                if action.dest in values:
                    action.required = False
        namespace, rest = parse_known_args(args, namespace)
        namespace.command_line = [*parser.prog.split(), *args]
        return namespace, rest

    parser.parse_known_args = parse_first


def config_path(args: list[str]) -> str | None:
    """The FILE of the last `--config FILE` / `--config=FILE` (argparse's rule: the last wins;
    the commands take no abbreviation of it, cli._Parser)."""
    path = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        option, eq, value = arg.partition("=")
        if option != FLAG:
            continue
        if eq:
            path = value
        elif i + 1 < len(args):
            path = args[i + 1]
    return path


def _abbreviated(args: list[str]) -> str | None:
    """A `--config` cut short (--conf FILE; --co would also be --compile), as typed."""
    for arg in args:
        if arg == "--":
            break
        option = arg.partition("=")[0]
        if len("--co") < len(option) < len(FLAG) and FLAG.startswith(option):
            return option
    return None


def _settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in _NOT_SETTINGS}


def load(path: str, actions: dict[str, argparse.Action]) -> tuple[dict, str | None]:
    """The settings in the file at `path`, checked against the parser's `actions` (dest ->
    action), and the note to print when some keys of a run's config.json were left out."""
    data = read_mapping(path)
    is_run = all(key in data for key in RUN_FACTS[:4])
    values, dropped = {}, []
    for key, value in data.items():
        name = str(key).strip().removeprefix("--").replace("-", "_")
        if is_run and name in RUN_FACTS:
            continue
        if is_run and name in NOT_REPEATED:
            dropped += [name] if value is not None else []
            continue
        if name not in actions:
            raise UsageError(_unknown(path, key, actions))
        if name in values:
            raise UsageError(f"{FLAG} {path}: {key!r} is given twice (as {name.replace('_', '-')} "
                             f"and {name}); keep one")
        values[name] = checked(path, key, value, actions[name])
    note = None
    if dropped:
        note = (f"{FLAG} {path} is a run's config.json: its {' and '.join(dropped)} "
                f"{'are' if len(dropped) > 1 else 'is'} not used, the run goes into a new folder "
                "(pass --out or --resume to choose)")
    return values, note


def read_mapping(path: str, what: str = FLAG,
                 examples: tuple[str, str] = (f"{FLAG} run.yaml", "`model: mlp`")) -> dict:
    """The file as a mapping: YAML (which also reads JSON), UTF-8 with or without a BOM, any line
    endings. Missing, unreadable, unparsable or not a mapping: one line that names it as
    `what` (the flag that gave it); `examples`: how such a file is given, and a line of it."""
    where = f"{what} {path}"
    given, line = examples
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file; give the path of a YAML or JSON file, e.g. "
                         f"{given}") from None
    except OSError as exc:
        raise UsageError(f"{where} cannot be read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig").replace("\r\n", "\n")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
                         ) from None
    data = _parse(text, where)
    if data is None:
        raise UsageError(f"{where} is empty; write one setting per line, e.g. {line}")
    if not isinstance(data, dict):
        raise UsageError(f"{where} holds a {type(data).__name__}, not a mapping of settings; "
                         f"write one `key: value` per line, e.g. {line}")
    return data


def _parse(text: str, where: str):
    try:
        import yaml
    except ImportError:
        yaml = None
    if yaml is not None:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            mark = getattr(exc, "problem_mark", None)
            error = f"{problem}" + (f" at line {mark.line + 1}" if mark is not None else "")
    try:
        return json.loads(text)  # JSON that YAML cannot read (tabs), or no PyYAML installed
    except ValueError as exc:
        if yaml is None:
            raise UsageError(f"{where} is not JSON ({exc}); for a YAML file install PyYAML "
                             "(pip install pyyaml)") from None
        raise UsageError(f"{where} is not valid YAML or JSON: {error}") from None


def _unknown(path: str, key, actions: dict) -> str:
    name = str(key).strip().removeprefix("--").replace("-", "_")
    close = difflib.get_close_matches(name, list(actions), n=1, cutoff=0.6)
    hint = (f"did you mean {close[0]!r}?" if close
            else "`multigpu train --help` lists them (as flags: batch-size or batch_size)")
    return f"{FLAG} {path}: unknown setting {key!r}; {hint}"


def checked(path: str, key, value, action: argparse.Action):
    """`value` as the flag's own type, or a UsageError naming key, value and what is expected."""
    flag, given = action.option_strings[0], value

    def wrong(expected: str) -> UsageError:
        return UsageError(f"{FLAG} {path}: {key}: {given!r} is not {expected} (as {flag})")

    if action.nargs == 0:  # a switch (store_true)
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if value is None:
        if action.default is None and not action.required:
            return None
        raise wrong(_expected(action))
    if isinstance(value, bool):
        if action.const is None:  # only a flag that may stand alone takes true / false
            raise wrong(_expected(action))
        value = action.const if value else None
    elif action.type in (int, float):
        if isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as text; the flag takes it
            try:
                value = float(value)
            except ValueError:
                raise wrong(_expected(action)) from None
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if not isinstance(value, (int, float)) or (action.type is int and not whole):
            raise wrong(_expected(action))
        value = action.type(value)
    elif action.type not in (None, str) and isinstance(value, (int, str)):
        try:  # a flag with a parser of its own (--batch-size: a number or auto)
            value = action.type(str(value))
        except (argparse.ArgumentTypeError, ValueError):
            raise wrong(_expected(action)) from None
    elif isinstance(value, (int, float, str)):
        value = str(value)  # devices: 4, checkpoint_every: 500 are the flags' text
    else:
        raise wrong(_expected(action))
    if action.choices is not None and value is not None and value not in action.choices:
        raise wrong("one of " + ", ".join(map(str, action.choices)))
    return value


def _expected(action: argparse.Action) -> str:
    kind = {int: "an integer", float: "a number"}.get(action.type, "text")
    if action.metavar and "|" in str(action.metavar):  # N|auto
        kind = " or ".join(str(action.metavar).replace("N", "an integer").split("|"))
    if action.choices is not None:
        kind = "one of " + ", ".join(map(str, action.choices))
    if action.const is not None:
        kind += " or true"
    return kind + (" or null" if action.default is None and not action.required else "")
