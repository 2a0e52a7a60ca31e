"""No internal function of the package takes more than 7 parameters (the developers' guide; issue
39 item 3): what a function works on travels as one value (the run's plan, the loop's state, a
loader's layout), not as a row of loose arguments.

Counted: every parameter a caller can give, positional or keyword-only; `*args` and `**kwargs`
count one each; a method's `self` / `cls` does not count. Not counted: the public API (the names
`multigpu.__all__` exports, and the methods of the classes among them: their keyword options are
the library's documented signature), and functions that mirror another's signature and must keep
it (MIRRORS)."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import multigpu

SRC = Path(multigpu.__file__).resolve().parent
MOST = 7

# path (from src/multigpu) :: qualified name -> the signature it mirrors
MIRRORS = {
    "auto/batchnorm.py::GlobalBatchNorm.install.batch_norm": "torch.nn.functional.batch_norm",
    "auto/writes/files.py::_open.open_": "builtins.open",
}


def _public() -> set[str]:
    """path::qualname of the public API's functions and of its classes' methods."""
    names = set()
    for name in multigpu.__all__:
        value = getattr(multigpu, name)
        path = Path(inspect.getsourcefile(value)).resolve().relative_to(SRC).as_posix()
        names.add(f"{path}::{value.__qualname__}")
        if inspect.isclass(value):
            names.update(f"{path}::{value.__qualname__}.{attr}" for attr in vars(value))
    return names


def count(args: ast.arguments, method: bool) -> int:
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    if method and names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (args.vararg is not None) + (args.kwarg is not None)


def _functions(tree: ast.AST, prefix: str = "", in_class: bool = False):
    """(qualified name, parameter count, line) of every function in `tree`, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, count(node.args, in_class), node.lineno
            yield from _functions(node, name + ".", False)
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".", True)
        else:
            yield from _functions(node, prefix, in_class)


def over_the_limit(root: Path = SRC) -> list[str]:
    exempt = _public() | set(MIRRORS)
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for name, n, line in _functions(ast.parse(path.read_text())):
            if n > MOST and f"{rel}::{name}" not in exempt:
                found.append(f"{rel}:{line} {name} takes {n} parameters")
    return found


def test_no_internal_function_takes_more_than_seven_parameters():
    assert over_the_limit() == []


def test_the_count_and_the_exemptions_are_what_they_say(tmp_path):
    (tmp_path / "m.py").write_text(
        "def eight(a, b, c, d, e, f, g, h): pass\n"
        "def seven(a, b, *args, c, d, e, **kw): pass\n"
        "def starred(a, b, c, d, e, f, *args, **kw): pass\n"
        "class K:\n"
        "    def method(self, a, b, c, d, e, f, g): pass\n"
        "    def wide(self, a, b, c, d, e, f, g, h): pass\n"
        "    @classmethod\n"
        "    def make(cls, a, b, c, d, e, f, g): pass\n"
        "def outer():\n"
        "    def inner(a, b, c, d, e, f, g, h): pass\n")
    assert over_the_limit(tmp_path) == ["m.py:1 eight takes 8 parameters",
                                        "m.py:3 starred takes 8 parameters",
                                        "m.py:6 K.wide takes 8 parameters",
                                        "m.py:10 outer.inner takes 8 parameters"]


def test_the_exemptions_name_functions_that_exist():
    """A mirror or public name renamed away would exempt nothing, silently."""
    every = {f"{p.relative_to(SRC).as_posix()}::{name}" for p in SRC.rglob("*.py")
             for name, _, _ in _functions(ast.parse(p.read_text()))}
    assert set(MIRRORS) <= every
    public = _public() & every
    assert any(f.endswith("::setup") for f in public)
    assert any(f.endswith("::ShardedBatchSampler.__init__") for f in public)
