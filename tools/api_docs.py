"""Render the docstrings of multigpu's public API into docs/api.md.

    python tools/api_docs.py            write docs/api.md
    python tools/api_docs.py --check    exit 1 when docs/api.md differs from the docstrings

The page is made only from the code (signatures and docstrings, through inspect), so it cannot
say something the code does not; tests/unit/test_api_docs.py fails when it is out of date.
Every name in `multigpu.__all__` must be placed in one of SECTIONS.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "api.md"

SECTIONS = [
    ("Setup and the training loop", ["setup", "Runtime"]),
    ("Distributed state", ["DistEnv", "init_distributed", "destroy_distributed"]),
    ("Mixed precision", ["Precision"]),
    ("Metrics across ranks", ["Sums", "MeanMetric", "Accuracy", "reduce_tensor"]),
    ("Data sharding", ["ShardedBatchSampler", "StepInfo", "ShardedImages"]),
    ("Models and checkpoints", ["DDPOptions", "FSDPOptions", "unwrap_model", "clean_state_dict",
                                "load_model_state", "load_model", "compile_model", "begin_step"]),
    ("Errors", ["UsageError"]),
]

HEADER = """# multigpu API

Generated from the docstrings by `python tools/api_docs.py`; do not edit by hand.
Everything here is importable as `multigpu.<name>`. A full loop: [examples/](../examples/);
the launcher (`multigpu run`, `multigpu train`): [launching.md](launching.md).
"""


class _Shown:
    """An annotation written as text (our modules use `from __future__ import annotations`),
    shown without the quotes that inspect would put around a string."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _plain(annotation):
    while isinstance(annotation, str):  # "'Runtime'" (a quoted name under future annotations)
        unquoted = annotation.strip("'\"")
        if unquoted == annotation:
            return _Shown(annotation)
        annotation = unquoted
    return annotation


def signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature
        return "(...)"
    params = [p.replace(annotation=_plain(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=_plain(sig.return_annotation)))


def public_members(cls) -> list[tuple[str, object]]:
    """Methods and properties the class itself defines, in source order, without _private ones
    and without dataclass fields (those are listed from dataclasses.fields)."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    out = []
    for name, value in vars(cls).items():
        if name.startswith("_") or name in fields:
            continue
        if isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(value):
            out.append((name, value))
    return out


def doc_of(obj, what: str) -> str:
    text = inspect.getdoc(obj.fget if isinstance(obj, property) else obj)
    if not text:
        raise SystemExit(f"api_docs: {what} has no docstring; write one, then run "
                         "python tools/api_docs.py")
    return to_markdown(text, param_names(obj))


def param_names(obj) -> set[str]:
    if isinstance(obj, (property, staticmethod, classmethod)):
        obj = getattr(obj, "fget", None) or obj.__func__
    try:
        names = set(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return set()
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        names |= {f.name for f in dataclasses.fields(obj)}
    return names


ARGUMENT = re.compile(r"(\w+(?:, \w+)*):\s+\S")  # "strategy:   ..." starts an entry


def to_markdown(doc: str, params: set[str]) -> str:
    """Docstring text as Markdown: indented blocks after a blank line become fenced code; a line
    `name: text` whose names are parameters in `params` becomes a list item (its indented
    continuation lines stay with it)."""
    out: list[str] = []
    code, blank, in_list = False, True, False
    for line in doc.splitlines():
        indented = line.startswith("    ")
        if code and line.strip() and not indented:
            _close_code(out)
            code = False
        if not code and blank and indented:
            out.append("```")
            code = True
        if code:
            out.append(line[4:])
        elif (m := ARGUMENT.match(line)) and set(m[1].split(", ")) <= params:
            out.append(f"- {line}")
            in_list = True
        else:
            if in_list and line.strip() and not line.startswith(" "):
                out.append("")  # a paragraph after the list, not a continuation of its last item
            in_list = in_list and line.startswith(" ")
            out.append(line)
        blank = not line.strip()
    if code:
        _close_code(out)
    return "\n".join(out).rstrip()


def _close_code(out: list[str]) -> None:
    while out[-1] == "":
        out.pop()
    out += ["```", ""]


def render_class(name: str, cls) -> list[str]:
    is_error = issubclass(cls, BaseException)
    init = "" if is_error else signature(cls).replace(" -> None", "")
    lines = [f"### class `{name}{init}`", "", _class_doc(name, cls), ""]
    if dataclasses.is_dataclass(cls):
        lines += ["Fields:", ""]
        lines += [f"- `{f.name}: {f.type}`{_default(f)}" for f in dataclasses.fields(cls)]
        lines.append("")
    for member, value in public_members(cls):
        if isinstance(value, property):
            head = f"#### `{name}.{member}` (property)"
        else:
            func = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            params = signature(func)
            if not isinstance(value, staticmethod):
                params = params.replace("(self, ", "(", 1).replace("(self)", "()", 1)
            head = f"#### `{name}.{member}{params}`"
        lines += [head, "", doc_of(value, f"{name}.{member}"), ""]
    return lines


def _class_doc(name: str, cls) -> str:
    own = cls.__dict__.get("__doc__")
    if not own or (dataclasses.is_dataclass(cls) and own.startswith(f"{cls.__name__}(")):
        raise SystemExit(f"api_docs: class {name} has no docstring of its own; write one")
    return to_markdown(inspect.cleandoc(own), param_names(cls))


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return f" = `{field.default!r}`"
    if field.default_factory is not dataclasses.MISSING:
        return f" = `{field.default_factory.__name__}()`"
    return ""


def render() -> str:
    import multigpu

    placed = [n for _, names in SECTIONS for n in names]
    missing = sorted(set(multigpu.__all__) - set(placed))
    if missing:
        raise SystemExit(f"api_docs: {', '.join(missing)} in multigpu.__all__ but in no section of "
                         "tools/api_docs.py SECTIONS; add them there")
    lines = [HEADER]
    for title, _ in SECTIONS:
        lines.append(f"- [{title}](#{title.lower().replace(' ', '-')})")
    lines.append("")
    for title, names in SECTIONS:
        lines += [f"## {title}", ""]
        for name in names:
            obj = getattr(multigpu, name)
            if inspect.isclass(obj):
                lines += render_class(name, obj)
            else:
                lines += [f"### `{name}{signature(obj)}`", "", doc_of(obj, name), ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write docs/api.md from the docstrings")
    p.add_argument("--check", action="store_true", help="only compare; exit 1 when out of date")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python tools/api_docs.py", file=sys.stderr)
            return 1
        return 0
    sys.path.insert(0, str(REPO / "src"))
    from multigpu.core.system.fileio import atomic_write_text

    atomic_write_text(PAGE, text)
    print(f"wrote {PAGE.relative_to(REPO)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    sys.exit(main())
