"""The doctor's checks of a script's DataParallel and DDP wrappers, read from its source (never run).

Traps 1, 5, 10, 11 and 12 of docs/traps.md: DataParallel under a launcher, in one process or on a
model never moved to the GPU; calls that go around a wrapper's forward; Python lists handed to a
DataParallel model; a wrapper's state_dict saved. Part of script_checks.py's findings; the
wrapped names come from pysource.py (Source.wrapped, Source.wrapper_kind).
"""
from __future__ import annotations

import ast
import functools

from multigpu.core.findings import Finding
from multigpu.doctor.pysource import Source, code, const, dotted, method

_WRAPPER_NAMES = {"dp": "DataParallel", "ddp": "DDP"}
_MOVES = ("cuda", "to")
_DDP_FIX = "multigpu.setup() then model = rt.prepare(model), which wraps in DDP per process"


def wrapper_findings(src: Source, nproc: int, gpus: bool) -> list[Finding]:
    """The wrapper traps of `src` for a launch of `nproc` processes (gpus: on GPUs), in the order
    DataParallel, forward bypasses, list arguments, checkpoints."""
    return [*_dataparallel(src, nproc, gpus), *_scatter(src), *_non_tensor_args(src),
            *_checkpoint(src)]


def _built_on_cpu(src: Source, expr: ast.expr | None) -> bool:
    """A model built here on the CPU: a class (`Net()`) or a torchvision/timm factory. A function
    of the script, torch.load or a move may hand back a GPU model: unsure, so False."""
    if not isinstance(expr, ast.Call):
        return False
    if method(expr) in ("eval", "train", "float"):
        return _built_on_cpu(src, expr.func.value)  # models.vgg16().eval()
    name = src.qualname(expr.func)
    local = {n.name for n in src.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    last = name.rsplit(".", 1)[-1]
    return name.startswith(("torchvision.", "timm.")) or last[:1].isupper() and last not in local


def _on_gpu(src: Source, call: ast.Call) -> bool:
    """Whether the model a DataParallel wraps may reach the GPU: moved by .cuda()/.to() before or
    after wrapping, anywhere in the file. True when unsure."""
    if not call.args or any(src.qualname(c.func).endswith("set_default_device") for c in src.calls):
        return True
    moved = [c.func.value for c in src.calls if method(c) in _MOVES]
    inner = call.args[0]
    names = {dotted(t) for n in src.nodes if isinstance(n, ast.Assign) and src.wrap_in(n.value) is call
             for t in n.targets} | {dotted(inner)}  # the model, and the names of the wrapper
    if any(m is call or dotted(m) in names - {None} for m in moved):
        return True
    return not _built_on_cpu(src, src.value(inner, call.lineno) if dotted(inner) else inner)


def _dataparallel(src: Source, nproc: int, gpus: bool) -> list[Finding]:
    """Traps 1 and 5: DataParallel under a launcher, in one process, or before the model moves."""
    found = []
    for call in (c for c in src.calls if src.wrapper_kind(c) == "dp"):
        if nproc > 1:
            why = (f"each of the {nproc} processes would replicate the model over all its visible GPUs"
                   if gpus else f"the {nproc} CPU processes would train {nproc} unsynced models")
            found.append(src.at("fail", "dataparallel", call, f"{code(call)} under multigpu run: "
                                f"{why}; fix: drop DataParallel and use {_DDP_FIX} (or start it once, "
                                f"python {src.path.name}, for DataParallel over all GPUs)", trap=5))
        elif gpus:
            found.append(src.at("warn", "dataparallel", call, "DataParallel is slower than DDP (one "
                                "process drives every GPU; GPU 0 gathers outputs and holds the "
                                f"optimizer); fix: multigpu run --devices N with {_DDP_FIX}", trap=5))
        if gpus and not _on_gpu(src, call):
            found.append(src.at("fail", "dataparallel", call, "the model is never moved to the GPU, so "
                                "DataParallel fails with 'module must have its parameters on cuda:0' "
                                "at the first forward; fix: move the model to the GPU first: "
                                "model.to('cuda'), then wrap", trap=1))
    return found


@functools.cache
def _attrs(kind: str) -> frozenset[str]:
    """What a DataParallel ('dp'), a DDP ('ddp') or a bare nn.Module ('module') answers to."""
    from torch import nn  # only these lists need torch: the script itself is never imported

    cls = {"dp": nn.DataParallel, "ddp": nn.parallel.DistributedDataParallel, "module": nn.Module}[kind]
    return frozenset(dir(cls))


def _bypass(src: Source, call: ast.Call) -> tuple[str, str, str] | None:
    """(kind, wrapped name, what is called) when `call` goes around a wrapper's forward:
    `m.module(x)`, `m.forward(x)`, `m.custom(x)`, `m.module.custom(x)` (DataParallel) or
    `m.module.forward(x)` for a wrapped `m`."""
    attr = method(call)
    if attr is None:
        return None
    recv = call.func.value
    wrap = src.wrapped(recv, call.lineno)
    if wrap is not None:
        kind = src.wrapper_kind(wrap)
        if attr in ("module", "forward") or attr not in _attrs(kind):
            return kind, dotted(recv), attr
    if isinstance(recv, ast.Attribute) and recv.attr == "module":
        wrap = src.wrapped(recv.value, call.lineno)
        kind = src.wrapper_kind(wrap) if wrap is not None else None
        # DataParallel: any custom method runs on one GPU (post 003). DDP: module.generate(...),
        # module.save_pretrained(...) are the bare model used on purpose, not a training step.
        if kind and (attr == "forward" or (kind == "dp" and attr not in _attrs("module"))):
            return kind, dotted(recv.value), f"module.{attr}"
    return None


def _scatter(src: Source) -> list[Finding]:
    """Trap 10: calls that skip DataParallel's scatter (one GPU) or DDP's forward (no sync)."""
    found = []
    for call in src.calls:
        hit = _bypass(src, call)
        if hit is None or hit[0] == "ddp" and src.in_no_grad(call.lineno):
            continue  # evaluation through DDP's bare module is fine: no gradient to sync
        kind, name, attr = hit
        wrapper = _WRAPPER_NAMES[kind]
        harm = ("the whole batch runs on one GPU" if kind == "dp"
                else "DDP does not ready the gradient all-reduce and ranks drift apart")
        if attr in ("module", "forward"):
            why, fix = f"goes around {wrapper}'s forward: {harm}", ""
        else:
            why = (f"goes around {wrapper}'s forward: {harm}" if "." in attr
                   else f"is not a {wrapper} method: AttributeError, or if forwarded, {harm}")
            fix = f" and call {attr.split('.')[-1]}(...) from forward"
        found.append(src.at("warn", "scatter", call,
                            f"{name}.{attr}(...) {why}; fix: call {name}(x){fix}", trap=10))
    return found


def _non_tensor_args(src: Source) -> list[Finding]:
    """Trap 11: a Python list of values (per-sample lengths, labels) passed to a DataParallel
    model is copied whole to every GPU, not split with the batch. A flag (True, "train") is meant
    to be copied, and containers of tensors are split by scatter: neither is named."""
    found = []
    for call in src.calls:
        named = isinstance(call.func, (ast.Name, ast.Attribute))
        wrap = src.wrapped(call.func, call.lineno) if named else None
        if wrap is None or src.wrapper_kind(wrap) != "dp":
            continue
        values = [*call.args, *(k.value for k in call.keywords)]
        literal = next((v for v in values if isinstance(v, (ast.List, ast.Tuple, ast.Set))
                        and len(v.elts) > 1 and all(const(e) is not None for e in v.elts)), None)
        if literal is not None:
            found.append(src.at("warn", "scatter", call, f"{code(literal)} passed to "
                                f"{dotted(call.func)} (DataParallel) is copied whole to every "
                                "GPU, not split with the batch; fix: pass per-sample values as a "
                                "tensor with the batch dimension first", trap=11))
    return found


def _checkpoint(src: Source) -> list[Finding]:
    """Trap 12: a wrapper's state_dict saved, its keys prefixed with `module.`."""
    found = []
    for call in (c for c in src.calls if src.qualname(c.func) == "torch.save" and c.args):
        for sub in ast.walk(call.args[0]):
            if not (isinstance(sub, ast.Call) and method(sub) == "state_dict"
                    and src.wrapped(sub.func.value, sub.lineno)):
                continue
            name = dotted(sub.func.value)
            found.append(src.at("warn", "checkpoint", call, f"saves {name}.state_dict() of a wrapped "
                                "model: every key gets a 'module.' prefix and will not load into a "
                                f"bare model; fix: torch.save({name}.module.state_dict(), ...)",
                                trap=12))
    return found
