"""The canary of torch's private names: each one multigpu reaches for (docs/torch-api.md) is
looked up on the installed torch, as the code uses it, so that a torch that renames one fails
here, loudly, instead of switching a guarded feature off without a word.

A name added to the code must be added to PRIVATE and to the docs' table; the scan below finds
the ones reached through torch's modules (imports of torch._x or of _x from torch, `torch._x`),
and the names reached on torch objects (`model._orig_mod`) are listed by hand."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


def _scaler_scale():
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(1))
    return isinstance(scaler._scale, torch.Tensor)


def _compiled_call_impl():
    model = nn.Linear(1, 1)
    before = model._compiled_call_impl
    model.compile()
    return before is None and model._compiled_call_impl is not None


def _flight_recorder():
    c10d = importlib.import_module("torch._C._distributed_c10d")
    return callable(getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None))


def _replicate():
    from torch.distributed._composable import replicate
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable.replicate import DDP

    return callable(replicate) and isinstance(DDP, type) and bool(REGISTRY_KEY) and bool(STATE_KEY)


def _saved(attr, make):
    x = torch.ones(2, 3, requires_grad=True)
    return getattr(make(x).grad_fn, attr, None) is not None


# name as docs/torch-api.md writes it -> a check that the installed torch has it as the code uses it
PRIVATE = {
    "GradScaler._scale": _scaler_scale,
    "OptimizedModule._orig_mod": lambda: isinstance(torch.compile(nn.Linear(1, 1))._orig_mod, nn.Linear),
    "Module._compiled_call_impl": _compiled_call_impl,
    '"_orig_mod." key prefix': lambda: all(k.startswith("_orig_mod.")
                                           for k in torch.compile(nn.Linear(1, 1)).state_dict()),
    "torch._C._distributed_c10d._dump_nccl_trace": _flight_recorder,
    "DistributedDataParallel.require_backward_grad_sync": lambda: "self.require_backward_grad_sync"
    in inspect.getsource(nn.parallel.DistributedDataParallel),
    "torch.distributed._composable.replicate": _replicate,
    "Module._modules": lambda: isinstance(nn.Sequential(nn.Linear(1, 1))._modules, dict),
    "torch.overrides._get_current_function_mode_stack":
        lambda: isinstance(importlib.import_module("torch.overrides")._get_current_function_mode_stack(), list),
    "grad_fn._saved_self_sym_sizes": lambda: _saved("_saved_self_sym_sizes", lambda x: x.sum()),
    "grad_fn._saved_other": lambda: _saved("_saved_other", lambda x: x / 4),
    "torch.distributed.utils._sync_module_states":
        lambda: callable(importlib.import_module("torch.distributed.utils")._sync_module_states),
    "torch._foreach_norm": lambda: len(torch._foreach_norm([torch.ones(2)], float("inf"))) == 1,
    "nn.modules.batchnorm._BatchNorm": lambda: issubclass(nn.BatchNorm2d, nn.modules.batchnorm._BatchNorm),
    "torch._dynamo": lambda: importlib.util.find_spec("torch._dynamo") is not None,
}


@pytest.mark.parametrize("name", sorted(PRIVATE))
def test_the_installed_torch_has_each_private_name_multigpu_uses(name):
    assert PRIVATE[name](), f"torch {torch.__version__} lacks {name}: see docs/torch-api.md"


def test_each_private_name_is_in_the_docs_table():
    table = (ROOT / "docs" / "torch-api.md").read_text().replace("`", "")
    assert [name for name in PRIVATE if name not in table] == []


def _private_module_names(source: str) -> set[str]:
    """The private names a source reaches through torch's modules: `import torch._x`,
    `from torch.a._b import c`, `from torch.x import _y`, `torch._x` (dunders left out)."""
    found = set()

    def private(dotted: str) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("torch") and private(a.name)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            found |= {f"{node.module}.{a.name}" for a in node.names if private(f"{node.module}.{a.name}")}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "torch" and private(node.attr):
            found.add(f"torch.{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith("torch._"):
            found.add(node.value)  # a module named to be imported (the start-up's head start)
    return found


def test_every_private_name_the_code_reaches_through_torch_s_modules_is_listed():
    listed = " ".join(PRIVATE)
    unlisted = {}
    for path in sorted((ROOT / "src" / "multigpu").rglob("*.py")):
        for name in _private_module_names(path.read_text()):
            if not any(part in listed for part in _listed_forms(name)):
                unlisted.setdefault(str(path.relative_to(ROOT)), []).append(name)
    assert unlisted == {}


def _listed_forms(name: str) -> list[str]:
    """`torch.distributed._composable.contract.STATE_KEY` is listed as its private module."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 1, -1)
            if parts[i - 1].startswith("_")] or [name]


def test_the_scan_finds_a_private_name_reached_through_torch():
    source = "import torch\nfrom torch.overrides import _x\nimport torch._y\nz = torch._z\n"
    assert _private_module_names(source) == {"torch.overrides._x", "torch._y", "torch._z"}
