"""What a sweep runs: a command template and a grid, expanded into one command line per run.

    command   an argv (a list; from a YAML string it is split like a shell would, but no shell
              ever runs it) with `{name}` placeholders: each grid key, and the sweep's own
              {out} (the run's folder), {name} (the run's name), {port} (a free TCP port) and
              {devices} (the run's devices, as `--devices` takes them)
    grid      key -> values; every combination is a run, in the grid's order; or a list of
              such grids, whose runs are put together (post 002 sweeps other lengths on its
              second dataset)
    include   extra combinations (each gives every key)
    exclude   partial combinations: every run matching one of them is left out

A placeholder is replaced inside its argument, which stays one argument whatever the value holds
(spaces, quotes): there is no shell string anywhere. For `multigpu train` the sweep also sets
--out (DIR/runs/NAME), --devices and, when the run has a checkpoint, --resume; a grid key named
like a train flag and not used as a placeholder becomes that flag (`--grid lr=1e-3,3e-3` is
enough for `multigpu train`).
"""
from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import os
import re
import shlex
from dataclasses import dataclass, field

from multigpu.core.errors import UsageError

BUILTINS = ("out", "name", "port", "devices")
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
SWEEP_SET = ("--out", "--devices", "--resume")  # flags of multigpu train/run the sweep sets
KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class SweepSpec:
    command: list[str]
    grid: dict[str, list] | list[dict[str, list]] = field(default_factory=dict)
    include: list[dict] = field(default_factory=list)
    exclude: list[dict] = field(default_factory=list)

    def fingerprint(self) -> str:
        """8 hex digits naming this sweep: the default folder, and the check that a re-run is the
        same sweep."""
        text = json.dumps([self.command, self.grid, self.include, self.exclude], sort_keys=True,
                          default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def grids(self) -> list[dict[str, list]]:
        return self.grid if isinstance(self.grid, list) else [self.grid]

    def keys(self) -> list[str]:
        """Every grid key, in the order they first appear."""
        return list(dict.fromkeys(k for g in self.grids() for k in g))

    def to_json(self) -> dict:
        return {"command": self.command, "grid": self.grid, "include": self.include,
                "exclude": self.exclude}


@dataclass(frozen=True)
class Run:
    name: str
    params: dict


# --------------------------------------------------------------------------- reading

def parse_grid_flag(text: str) -> tuple[str, list[str]]:
    """`--grid seq_length=40,60,80` -> ("seq_length", ["40", "60", "80"])."""
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not KEY.fullmatch(key) or not values.strip():
        raise UsageError(f"--grid {text!r}: write NAME=V1,V2,... e.g. --grid seq_length=40,60,80")
    return key, [v.strip() for v in values.split(",") if v.strip()]


def from_mapping(data: dict, where: str, allowed: tuple[str, ...] | None = None
                 ) -> tuple[SweepSpec, dict]:
    """A YAML file's mapping -> (spec, the sweep options it sets: devices_per_run, ...).
    `allowed`: the option names a file may set; an unknown key is refused first, so that a
    misspelt `comand:` is named as such rather than reported as a missing `command:`."""
    known = ("command", "grid", "include", "exclude")
    # YAML 1.1 reads the key `on:` (on: slurm) as the boolean True
    options = {("on" if k is True else str(k)).replace("-", "_"): v for k, v in data.items()
               if k not in known}
    if allowed is not None:
        _refuse_unknown(where, options, known + tuple(allowed))
    if "command" not in data:
        raise UsageError(f"{where} has no `command:`; add the command each run executes, e.g. "
                         "command: multigpu train --model lstm --data {data}")
    command = data["command"]
    if isinstance(command, str):
        command = shlex.split(command.replace("\\\n", " "))
    if not (isinstance(command, list) and command and all(isinstance(a, (str, int, float)) for a in command)):
        raise UsageError(f"{where}: `command:` must be a command line (a string) or a list of "
                         "arguments")
    grid = data.get("grid") or {}
    grids = grid if isinstance(grid, list) else [grid]
    if not grids or not all(isinstance(g, dict) for g in grids):
        raise UsageError(f"{where}: `grid:` must map names to lists of values, e.g. "
                         "grid: {seq_length: [40, 60, 80]} (or be a list of such maps)")
    grids = [{str(k): _values(where, str(k), v) for k, v in g.items()} for g in grids]
    grid = grids if isinstance(grid, list) else grids[0]
    spec = SweepSpec([str(a) for a in command], grid, _combos(data, "include", where),
                     _combos(data, "exclude", where))
    return spec, options


def _refuse_unknown(where: str, options: dict, names: tuple[str, ...]) -> None:
    unknown = [k for k in options if k not in names]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], names, n=1, cutoff=0.6)
    hint = (f"did you mean {close[0]!r}?" if close
            else f"a sweep file holds {', '.join(names[:4])} and {', '.join(names[4:])}")
    raise UsageError(f"{where}: unknown setting {unknown[0]!r}; {hint}")


def _values(where: str, key: str, values) -> list:
    """A grid key's values as a list (one value alone is a list of one). Each becomes text in a
    command line, so a mapping, a list or an empty value is a mistake of the file's layout,
    refused here rather than run as the text "{'a': 1}" or "None"."""
    example = f"e.g. {key}: [0.001, 0.01]"
    if values is None:
        raise UsageError(f"{where}: grid key {key!r} has no values; give a list, {example}")
    values = values if isinstance(values, list) else [values]
    for v in values:
        if v is None or isinstance(v, (dict, list)):
            raise UsageError(f"{where}: grid key {key!r}: {v!r} is not a value; give a list of "
                             f"numbers or words, {example}")
    return values


def _combos(data: dict, key: str, where: str) -> list[dict]:
    value = data.get(key) or []
    if not (isinstance(value, list) and all(isinstance(c, dict) for c in value)):
        raise UsageError(f"{where}: `{key}:` must be a list of combinations, e.g. "
                         f"{key}: [{{seq_length: 80, future_length: 8}}]")
    return [{str(k): v for k, v in c.items()} for c in value]


# --------------------------------------------------------------------------- checking and expanding

def check(spec: SweepSpec) -> None:
    """Every mistake that would otherwise show up in N failed runs, as one line now."""
    if not spec.command:
        raise UsageError("no command to sweep: put it after --, e.g. multigpu sweep --grid "
                         "lr=1e-3,3e-3 -- multigpu train --model cnn --data digits")
    for key, values in (kv for g in spec.grids() for kv in g.items()):
        if not KEY.fullmatch(key) or key in BUILTINS:
            raise UsageError(f"grid key {key!r}: use a name of letters, digits and _ other than "
                             f"{', '.join(BUILTINS)}")
        if not values:
            raise UsageError(f"grid key {key!r} has no values; give at least one")
        if len(set(map(str, values))) != len(values):
            raise UsageError(f"grid key {key!r} lists a value twice: {values}")
    used = {m for a in spec.command for m in PLACEHOLDER.findall(a)}
    unknown = sorted(used - set(spec.keys()) - set(BUILTINS) - {k for c in spec.include for k in c})
    if unknown:
        raise UsageError(f"the command uses {{{unknown[0]}}}, which is not a grid key; add "
                         f"--grid {unknown[0]}=V1,V2 or remove it (built in: "
                         f"{', '.join('{' + b + '}' for b in BUILTINS)})")
    for g in spec.grids() + spec.include:
        lacking = sorted(used - set(g) - set(BUILTINS))
        if lacking and len(spec.grids()) + len(spec.include) > 1:
            raise UsageError(f"the command uses {{{lacking[0]}}}, but the grid or include {g} "
                             f"gives it no value; add {lacking[0]} there")
    train = train_flags(spec.command)
    given = {a.split("=", 1)[0] for a in spec.command}
    for key in spec.keys():
        flag = "--" + key.replace("_", "-")
        if key not in used and (train is None or key not in train):
            raise UsageError(f"grid key {key!r} is not used in the command; add {{{key}}} where "
                             f"its value goes, e.g. {flag} {{{key}}}")
        if key not in used and flag in given:
            raise UsageError(f"the command sets {flag} itself while the grid sweeps {key}; "
                             f"remove {flag} from the command, or write {flag} {{{key}}}")
    for e in spec.exclude:
        unknown = sorted(set(e) - set(spec.keys()))
        if unknown:
            raise UsageError(f"exclude {e}: {unknown[0]!r} is not a grid key (they are "
                             f"{', '.join(spec.keys())})")
    for flag in _sweep_set_flags(spec.command):
        raise UsageError(f"the command sets {flag}, which the sweep sets for each run; remove it "
                         "(devices: --devices-per-run; folders: the sweep's --out)")
    for c in spec.include:
        missing = [k for k in spec.keys() if k not in c]
        if missing:
            raise UsageError(f"include {c}: give a value for {', '.join(missing)} too")


def _sweep_set_flags(command: list[str]) -> list[str]:
    """Flags of the command that the sweep sets itself: --out/--devices/--resume of multigpu
    train; --devices of multigpu run before its script (what follows is the script's)."""
    sub = subcommand(command)
    if sub == "train":
        return [a.split("=", 1)[0] for a in command if a.split("=", 1)[0] in SWEEP_SET]
    if sub == "run":
        found = []
        for a in command[command.index("run") + 1:]:
            if a.endswith(".py") or a in ("-m", "--module", "--"):
                break
            if a.split("=", 1)[0] == "--devices":
                found.append("--devices")
        return found
    return []


def expand(spec: SweepSpec) -> list[Run]:
    """The runs, in order: the grid's combinations less the excluded ones, then the includes."""
    combos = [dict(zip(g, values)) for g in spec.grids() for values in itertools.product(*g.values())]
    combos = [c for i, c in enumerate(combos) if not any(_same(c, d) for d in combos[:i])]
    combos = [c for c in combos if not any(_matches(c, e) for e in spec.exclude)]
    for c in spec.include:
        if not any(_same(c, d) for d in combos):
            combos.append(dict(c))
    runs, names = [], set()
    for c in combos:
        name = run_name(c)
        if name in names:
            raise UsageError(f"two runs would share the folder {name!r}; make their values differ")
        names.add(name)
        runs.append(Run(name, c))
    return runs


def _matches(combo: dict, partial: dict) -> bool:
    return all(str(combo.get(k)) == str(v) for k, v in partial.items())


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and _matches(a, b)


def run_name(params: dict) -> str:
    """A folder name from the values: `seq_length=40,future_length=4`; long ones are cut and
    given a hash, so that two runs never share one."""
    text = ",".join(f"{k}={v}" for k, v in params.items()) or "run"
    safe = re.sub(r"[^A-Za-z0-9._=,+-]", "-", text).strip(".")
    if len(safe) > 100:
        safe = f"{safe[:90]}-{hashlib.sha256(text.encode()).hexdigest()[:6]}"
    return safe


# --------------------------------------------------------------------------- one run's command

def subcommand(command: list[str]) -> str | None:
    """"train" for `multigpu train ...` (or `python -m multigpu train`), "run", ..., else None."""
    words = command
    if len(words) > 2 and os.path.basename(words[0]).startswith("python") and words[1:3] == ["-m", "multigpu"]:
        words = words[2:]
    if len(words) > 1 and os.path.basename(words[0]) == "multigpu":
        rest = [w for w in words[1:] if w != "--debug"]
        return rest[0] if rest else None
    return None


def train_flags(command: list[str]) -> set[str] | None:
    """The names of multigpu train's settings when `command` is a train command, else None."""
    if subcommand(command) != "train":
        return None
    from multigpu.train.settings.config import FLAT_NAMES

    return set(FLAT_NAMES)


def argv_for(spec: SweepSpec, run: Run, values: dict) -> list[str]:
    """The run's command line: placeholders replaced (grid values, then `values`: out, name,
    port, devices), and for multigpu train/run the flags the sweep sets (--master-port: the
    port every node of a run of several nodes meets at)."""
    table = {**{k: str(v) for k, v in run.params.items()}, **values, "name": run.name}
    argv = [PLACEHOLDER.sub(lambda m: table.get(m.group(1), m.group(0)), a) for a in spec.command]
    used = {m for a in spec.command for m in PLACEHOLDER.findall(a)}
    sub = subcommand(argv)
    if sub is None:
        return argv
    at = argv.index(sub) + 1
    meet = ["--master-port", values["master_port"]] if values.get("master_port") else []
    if sub == "train":
        extra = ["--out", values["out"], "--devices", values["devices"], *meet]
        if values.get("min_free_memory") is not None:  # the sweep's, so a shared GPU stays usable
            extra += ["--min-free-memory", values["min_free_memory"]]
        extra += [a for k, v in run.params.items() if k not in used
                  for a in (f"--{k.replace('_', '-')}", str(v))]
        if values.get("resume"):
            extra += ["--resume", values["resume"]]
        return argv[:at] + extra + argv[at:]
    if sub == "run":
        return argv[:at] + ["--devices", values["devices"], *meet] + argv[at:]
    return argv


def multigpu_prefix(argv: list[str]) -> list[str]:
    """`multigpu ...` runs with this interpreter (the venv need not be on PATH)."""
    if argv and argv[0] == "multigpu":
        import sys

        return [sys.executable, "-P", "-m", "multigpu", *argv[1:]]
    return argv
