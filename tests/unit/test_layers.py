"""The package's layers (pyproject.toml [tool.importlinter]): each imports only the layers below it,
and no modules import each other in a circle. Imports inside functions count as much as those at
the top of a module: a function-level import is still a dependency, only a later one."""
from __future__ import annotations

from pathlib import Path

import grimp
import pytest

import multigpu

REPO = Path(__file__).resolve().parents[2]


def test_this_checkout_is_the_one_analysed():
    assert Path(multigpu.__file__).resolve().parent == REPO / "src" / "multigpu"


def test_each_layer_imports_only_the_layers_below_it(capsys):
    from importlinter.cli import lint_imports

    code = lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True, no_logo=True)
    assert code == 0, capsys.readouterr().out[-4000:]


def _circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan). A package and its own
    submodules importing each other (an __init__ re-exporting a name) is not a circle."""
    def related(a: str, b: str) -> bool:
        return a.startswith(b + ".") or b.startswith(a + ".")

    edges = {m: {t for t in graph.find_modules_directly_imported_by(m) if not related(m, t)}
             for m in graph.modules if m.startswith("multigpu.")}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_function_level_imports_included():
    graph = grimp.build_graph("multigpu", cache_dir=None)
    assert _circles(graph) == []


@pytest.mark.parametrize("importer, imported", [("multigpu.core.distributed", "multigpu.core.system.orphans"),
                                                ("multigpu.train.announce", "multigpu.train.checks.setup_checks")])
def test_function_level_imports_are_in_the_graph(importer, imported):
    """Both are imported inside a function only: a graph without them would let a layer break."""
    graph = grimp.build_graph("multigpu", cache_dir=None)
    assert imported in graph.find_modules_directly_imported_by(importer)


def test_the_launcher_names_no_module_of_a_layer_above_it():
    """`multigpu run --auto`'s worker (multigpu.auto) sits above the launcher: the caller names it
    in the command line it gives the launcher, which neither imports it nor names it."""
    graph = grimp.build_graph("multigpu", cache_dir=None)
    assert not graph.chain_exists("multigpu.launcher", "multigpu.auto", as_packages=True)
    assert any(m.startswith("multigpu.launcher.")
               for m in graph.find_modules_directly_imported_by("multigpu.auto.worker"))
    above = ("multigpu.auto", "multigpu.train", "multigpu.bench", "multigpu.sweep", "multigpu.doctor",
             "multigpu.cli")
    launcher = Path(__file__).resolve().parents[2] / "src" / "multigpu" / "launcher"
    named = {(p.name, text) for p in launcher.rglob("*.py") for text in _strings_in_code(p)
             if text.startswith(above)}
    assert named == set()


def _strings_in_code(path: Path) -> list[str]:
    """The string literals of a module's code: its docstrings (words about it) left out."""
    import ast

    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docs]
