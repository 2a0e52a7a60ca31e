"""A Python script's source, parsed for the doctor's checks (script_checks.py): its imports, the
names it binds (in line order, without scopes), its calls and its no_grad blocks.

Nothing here runs or imports the script.
"""
from __future__ import annotations

import ast
from pathlib import Path

from multigpu.core.findings import Finding
from multigpu.train.checks.setup_checks import LAUNCH_VARS

WRAPPERS = {"DataParallel": "dp", "DistributedDataParallel": "ddp", "DDP": "ddp"}


def dotted(node: ast.AST) -> str | None:
    """`self.model` for an Attribute chain ending in a Name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def code(node: ast.AST, limit: int = 48) -> str:
    text = ast.unparse(node)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def const(node: ast.AST | None):
    return node.value if isinstance(node, ast.Constant) else None


def method(call: ast.Call) -> str | None:
    """`cuda` for `x.cuda()`: the name of a method call."""
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


class Source:
    """A parsed script and what the checks share: its imports, its calls, where each name is bound
    (and to what), and the torch.no_grad() blocks."""

    def __init__(self, path: Path, tree: ast.Module, text: str):
        self.path, self.text = path, text
        self.nodes = list(ast.walk(tree))
        self.calls = [n for n in self.nodes if isinstance(n, ast.Call)]
        self.aliases, self.imported = _imports(self.nodes)
        self.binds = _bindings(self.nodes)
        self.no_grad = [(n.lineno, n.end_lineno) for n in self.nodes if _is_no_grad_block(n)]
        # `if "RANK" not in os.environ: ...`: code that runs only with (or without) a launcher
        self.launch_guarded = [(n.lineno, n.end_lineno) for n in self.nodes
                               if isinstance(n, ast.If) and _tests_launch_env(n.test)]

    def at(self, level: str, check: str, node: ast.AST, msg: str, trap: int | None = None) -> Finding:
        return Finding(level, check, msg, trap=trap, where=f"{self.path}:{node.lineno}")

    def qualname(self, node: ast.AST) -> str:
        """`torch.cuda.amp.autocast` for `autocast` after `from torch.cuda.amp import autocast`."""
        head, dot, rest = (dotted(node) or "").partition(".")
        return self.aliases.get(head, head) + dot + rest

    def wrapper_kind(self, call: ast.Call) -> str | None:
        """'dp' or 'ddp' when `call` builds a DataParallel / DistributedDataParallel."""
        return WRAPPERS.get(self.qualname(call.func).rsplit(".", 1)[-1])

    def wrap_in(self, expr: ast.AST | None) -> ast.Call | None:
        """The wrapper call that `expr` is, or that method calls follow (`DataParallel(m).cuda()`)."""
        while isinstance(expr, ast.Call):
            if self.wrapper_kind(expr):
                return expr
            expr = expr.func.value if method(expr) else None
        return None

    def value(self, node: ast.AST, line: int) -> ast.expr | None:
        """What the name `node` was last assigned before `line`; None when unknown."""
        before = [b for b in self.binds.get(dotted(node) or "", ()) if b[0] < line]
        return max(before, key=lambda b: b[0])[1] if before else None

    def wrapped(self, node: ast.AST, line: int) -> ast.Call | None:
        """The wrapper call whose result the name `node` holds at `line`, if it is one."""
        return self.wrap_in(self.value(node, line))

    def in_no_grad(self, line: int) -> bool:
        return any(start <= line <= end for start, end in self.no_grad)

    def in_launch_guard(self, line: int) -> bool:
        """Inside an `if` (either branch) that asks whether a launcher set the environment."""
        return any(start <= line <= end for start, end in self.launch_guarded)


def _imports(nodes: list[ast.AST]) -> tuple[dict[str, str], dict[str, ast.AST]]:
    """Local name -> what it imports (`DDP` -> `torch.nn.parallel.DistributedDataParallel`), and
    top-level package -> its first import statement."""
    aliases, imported = {}, {}
    for node in nodes:
        if isinstance(node, ast.Import):
            aliases.update((a.asname, a.name) for a in node.names if a.asname)
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            aliases.update((a.asname or a.name, f"{node.module}.{a.name}") for a in node.names)
            modules = [node.module]
        else:
            continue
        for m in modules:
            imported.setdefault(m.split(".")[0], node)
    return aliases, imported


def _bindings(nodes: list[ast.AST]) -> dict[str, list[tuple[int, ast.expr | None]]]:
    """Name -> (line, assigned value or None) for every store of it, parameters included."""
    values = {}
    for node in nodes:
        if isinstance(node, ast.Assign):
            values.update((id(t), node.value) for t in node.targets)
        elif isinstance(node, ast.AnnAssign):
            values[id(node.target)] = node.value
    binds = {}
    for node in nodes:
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            name = dotted(node)
        else:
            name = node.arg if isinstance(node, ast.arg) else None
        if name:
            binds.setdefault(name, []).append((node.lineno, values.get(id(node))))
    return binds


def _is_no_grad_block(node: ast.AST) -> bool:
    """A `with torch.no_grad():` (or inference_mode) block, or a function decorated with one."""
    if isinstance(node, (ast.With, ast.AsyncWith)):
        exprs = [item.context_expr for item in node.items]
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        exprs = node.decorator_list
    else:
        return False
    names = [dotted(e.func if isinstance(e, ast.Call) else e) or "" for e in exprs]
    return any(n.rsplit(".", 1)[-1] in ("no_grad", "inference_mode") for n in names)


_LAUNCH_WORDS = (*LAUNCH_VARS, "TORCHELASTIC_RUN_ID", "SLURM_PROCID")


def _tests_launch_env(test: ast.AST) -> bool:
    """Whether an `if` test reads os.environ or names a launch variable."""
    for node in ast.walk(test):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
            return True
        if isinstance(node, ast.Constant) and node.value in _LAUNCH_WORDS:
            return True
    return False

