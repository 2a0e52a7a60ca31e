"""What `multigpu run --auto` will change in a script, said before it runs: `multigpu doctor --auto`.

Built from the two things doctor already does with a script, because neither alone can say it:

- the source, read with ast (pysource.py), gives each change of multigpu.auto.CHANGES its place
  (file:line) without running anything, and shows the refusals a source can show (an
  init_process_group call, a batch_sampler of the script's own, a sampler that draws with
  replacement, a global batch that does not divide);
- but --auto judges by what the script does when it runs, not by its text: a line may never run,
  and a `DataLoader(ds, **kwargs)` shuffles or not as the kwargs say at that moment
  (pytorch/examples' MNIST shuffles only on GPUs). So a refusal read here is a warn worded "if
  it runs", a loader whose shuffle the source does not show is "decided when it runs", and the
  trial (auto_trial.py: the script under --auto's own worker, up to its first optimizer step)
  decides for these arguments: a refusal there is a fail.

Every check stays silent when it cannot tell, as script_checks.py's do.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from collections.abc import Callable, Iterator

from multigpu.auto import CHANGES
from multigpu.doctor.pysource import Source, code, const, dotted, kw, method
from multigpu.core.findings import Finding

_CUDA = re.compile(r"cuda(:\d+)?")
_RANDOM = ("RandomSampler", "SubsetRandomSampler")
_WRAPPING_CALLS = ("enumerate", "tqdm", "iter", "zip")


def auto_findings(path: Path, *, nproc: int, mode: str, ran: bool) -> list[Finding]:
    """What --auto changes in the Python script at `path` for `nproc` processes (mode: the
    --auto-batch choice), line by line; then what is left to run time (ran: whether the trial
    follows)."""
    data = path.read_bytes()
    try:
        tree = ast.parse(data, filename=str(path))
    except (SyntaxError, ValueError) as e:  # ValueError: a null byte
        return [Finding("fail", "syntax", f"Python cannot parse it ({getattr(e, 'msg', e)}); fix "
                        "this line", where=f"{path}:{getattr(e, 'lineno', None) or 1}")]
    src = Source(path, tree, data.decode(errors="replace"))
    found = []
    for what, effect in CHANGES:
        check, finder = FINDERS[what]
        nodes = list(dict.fromkeys(finder(src)))
        if nodes:
            found.append(_change(src, check, nodes, effect, refusal="refused" in effect))
    found += _unknown_shuffle(src)
    found += [src.at("warn", "auto refuses", node, msg) for node, msg in _refusals(src, nproc, mode)]
    found.sort(key=lambda f: int(f.where.rsplit(":", 1)[1]))
    return found + [runtime_finding(ran)]


def runtime_finding(ran: bool) -> Finding:
    then = ("the run below shows it for these arguments" if ran else
            "--no-step: not run; doctor --auto without it runs the script to its first step")
    return Finding("ok", "auto run", "decided when the script runs, not by this reading: whether "
                   "each line above runs, the shuffle of a DataLoader the source does not show, "
                   f"and every refusal (--auto refuses what the script does, when it does it); {then}")


def _change(src: Source, check: str, nodes: list[ast.AST], effect: str, refusal: bool) -> Finding:
    """One line per change: its first place, the other lines, and what --auto does there."""
    nodes = sorted(nodes, key=lambda n: (n.lineno, n.col_offset))
    lines = sorted({n.lineno for n in nodes})
    also = f" (and line{'s' if len(lines) > 2 else ''} {', '.join(map(str, lines[1:]))})" \
        if len(lines) > 1 else ""
    effect = re.sub(r" \([\w.]+\.py\)$", "", effect)
    if refusal:
        level, verb, effect = "warn", "if it runs, --auto refuses it there: ", effect.split(": ", 1)[-1]
    else:  # work --auto leaves whole on every process: a warn, as the run's note
        level, verb = "warn" if check == "auto unsplit" else "ok", "--auto: "
    return src.at(level, check, nodes[0], f"{_shown(nodes[0])}{also}: {verb}{effect}")


def _shown(node: ast.AST) -> str:
    if isinstance(node, ast.For):  # its header, not its body
        target = node.target.elts if isinstance(node.target, ast.Tuple) else [node.target]
        return f"for {', '.join(map(code, target))} in {code(node.iter)} under torch.no_grad()"
    if isinstance(node, ast.ClassDef):  # its name and bases, not its body
        return f"class {node.name}({', '.join(map(code, node.bases))})"
    return code(node)


# --- where each change applies --------------------------------------------------------------------

def _devices(src: Source) -> Iterator[ast.AST]:
    for node in src.nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _CUDA.fullmatch(node.value):
            yield node
        elif isinstance(node, ast.Call) and (method(node) == "cuda" or src.wrapper_kind(node) == "dp"):
            yield node


def _loaders(src: Source) -> list[ast.Call]:
    return [c for c in src.calls if src.qualname(c.func).rsplit(".", 1)[-1] == "DataLoader"]


def _shuffle(src: Source, call: ast.Call) -> bool | None:
    """Whether the DataLoader built by `call` shuffles: None when its source does not say."""
    shuffle = kw(call, "shuffle") or (call.args[2] if len(call.args) > 2 else None)
    sampler = kw(call, "sampler")
    if sampler is not None:
        built = src.value(sampler, call.lineno) if dotted(sampler) else sampler
        name = src.qualname(built.func).rsplit(".", 1)[-1] if isinstance(built, ast.Call) else ""
        return True if name in _RANDOM else None
    if shuffle is not None:
        return const(shuffle) if isinstance(const(shuffle), bool) else None
    if any(k.arg is None for k in call.keywords) or kw(call, "batch_sampler") is not None:
        return None  # DataLoader(ds, **kwargs): shuffle may be in there
    return False


def _shuffled(src: Source) -> Iterator[ast.AST]:
    return (c for c in _loaders(src) if _shuffle(src, c) is True)


def _whole(src: Source) -> Iterator[ast.AST]:
    return (c for c in _loaders(src) if _shuffle(src, c) is False)


def _streams(src: Source) -> Iterator[ast.AST]:
    """The script's own IterableDataset classes (a loader over one is split as a stream)."""
    return (node for node in src.nodes if isinstance(node, ast.ClassDef) and "IterableDataset"
            in [(dotted(b) or "").rsplit(".", 1)[-1] for b in node.bases])


def _no_grad_loops(src: Source) -> Iterator[ast.AST]:
    """`for ... in loader` under torch.no_grad(): a loader by its name, or one built right there."""
    return (node for node in _loader_loops(src) if src.in_no_grad(node.lineno))


def _loader_loops(src: Source) -> Iterator[ast.For]:
    """`for ... in loader`: a loader by its name, or one built right there."""
    for node in src.nodes:
        if not isinstance(node, ast.For):
            continue
        it = node.iter
        while isinstance(it, ast.Call) and (dotted(it.func) or "").rsplit(".", 1)[-1] in _WRAPPING_CALLS \
                and it.args:
            it = it.args[0]
        name = dotted(it) or ""
        built = src.value(it, node.lineno) if name else None
        if "loader" in name.lower() or (isinstance(built, ast.Call) and built in _loaders(src)):
            yield node


def _optimizers(src: Source) -> Iterator[ast.AST]:
    for c in src.calls:
        name = src.qualname(c.func)
        if name.startswith("torch.optim.") and ".lr_scheduler." not in name \
                and name.rsplit(".", 1)[-1][:1].isupper():
            yield c


def _direct_forwards(src: Source) -> Iterator[ast.AST]:
    """`x.forward(...)`, not `super().forward(...)` (a subclass's forward, inside a module call)."""
    return (c for c in src.calls if method(c) == "forward" and not (
        isinstance(c.func.value, ast.Call) and dotted(c.func.value.func) == "super"))


_BATCHNORMS = {f"{lazy}BatchNorm{d}d" for lazy in ("", "Lazy") for d in (1, 2, 3)}


def _batchnorms(src: Source) -> Iterator[ast.AST]:
    return (c for c in src.calls if src.qualname(c.func).rsplit(".", 1)[-1] in _BATCHNORMS)


def _traces(src: Source) -> Iterator[ast.AST]:
    """torch.jit.trace / trace_module, torch.export.export, a SummaryWriter's add_graph."""
    return (c for c in src.calls if method(c) == "add_graph" or src.qualname(c.func) in (
        "torch.jit.trace", "torch.jit.trace_module", "torch.export.export"))


def _summed_losses(src: Source) -> Iterator[ast.AST]:
    return (c for c in src.calls if const(kw(c, "reduction")) == "sum" and not src.in_no_grad(c.lineno))


def _unsplit(src: Source) -> Iterator[ast.AST]:
    """The backward calls of a script whose code names no optimizer at all (a hand-written
    update), or no loader at all (batches sliced from a tensor): where its training starts.
    Silent when a name in its code has one in it, a helper's too: it may come from elsewhere."""
    names = " ".join(_identifiers(src)).lower()
    if "optim" in names and "loader" in names:
        return
    for c in src.calls:
        if method(c) == "backward" or src.qualname(c.func) in ("torch.autograd.grad",
                                                              "torch.autograd.backward"):
            yield c


def _identifiers(src: Source) -> Iterator[str]:
    for node in src.nodes:
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.alias):
            yield node.name
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name


_DRAWS = ("torch.randn", "torch.rand", "torch.randint", "torch.randperm", "torch.normal",
          "numpy.random.", "random.")
_SEEDS = ("manual_seed", "seed", "seed_everything")


def _unseeded_draws(src: Source) -> Iterator[ast.AST]:
    """Random draws of a source that seeds nothing (a seed of its own makes --auto's moot)."""
    if any(method(c) in _SEEDS or src.qualname(c.func).rsplit(".", 1)[-1] in _SEEDS
           for c in src.calls):
        return iter(())
    return (c for c in src.calls if src.qualname(c.func).startswith(_DRAWS))


_WRITES = ("numpy.save", "numpy.savez", "numpy.savez_compressed", "numpy.savetxt", "shutil.copy",
           "shutil.copyfile", "shutil.copy2", "shutil.copytree", "shutil.move", "shutil.rmtree",
           "os.makedirs", "os.mkdir", "os.remove", "os.rename", "os.replace")


def _writes(src: Source) -> Iterator[ast.AST]:
    """Files and folders the script makes: open() for writing, savefig, save_image, numpy and
    shutil's writers, os's folder calls."""
    for c in src.calls:
        name = src.qualname(c.func)
        if name == "open":
            mode = const(kw(c, "mode")) if kw(c, "mode") is not None else (
                const(c.args[1]) if len(c.args) > 1 else "r")
            if isinstance(mode, str) and set(mode) & set("wax+"):
                yield c
        elif name in _WRITES or method(c) in ("savefig", "save_image"):
            yield c


def _saves(src: Source) -> Iterator[ast.AST]:
    return (c for c in src.calls if src.qualname(c.func) == "torch.save")


def _prints(src: Source) -> Iterator[ast.AST]:
    return (c for c in src.calls if src.qualname(c.func) == "print" or
            src.qualname(c.func).rsplit(".", 1)[-1] == "tqdm")


def _init_process_group(src: Source) -> Iterator[ast.AST]:
    return (c for c in src.calls if src.qualname(c.func).endswith("init_process_group"))


# CHANGES' first words -> (the check's name, where in a source that change applies)
FINDERS: dict[str, tuple[str, Callable[[Source], Iterator[ast.AST]]]] = {
    "CUDA": ("auto devices", _devices),
    "DataLoader(shuffle=True)": ("auto data", _shuffled),
    "DataLoader without shuffle": ("auto data", _whole),
    "DataLoader over an IterableDataset (a stream)": ("auto data", _streams),
    "a shuffled DataLoader read under torch.no_grad()": ("auto eval", _no_grad_loops),
    "optimizer": ("auto gradients", _optimizers),
    "BatchNorm (nn.BatchNorm1d, 2d, 3d)": ("auto batchnorm", _batchnorms),
    "torch.jit.trace, tensorboard's add_graph, torch.export.export": ("auto trace", _traces),
    "a forward called directly (model.forward(x))": ("auto gradients", _direct_forwards),
    "a torch loss with reduction='sum'": ("auto loss", _summed_losses),
    "training without a torch.optim optimizer, or on batches from no DataLoader":
        ("auto unsplit", _unsplit),
    "random numbers the script draws without a seed": ("auto seeds", _unseeded_draws),
    "torch.save(obj, path)": ("auto save", _saves),
    "files the script writes (open(path, 'w'), savefig, np.save, save_image, shutil)":
        ("auto files", _writes),
    "print, tqdm": ("auto output", _prints),
    "torch.distributed.init_process_group": ("auto refuses", _init_process_group),
}


def _unknown_shuffle(src: Source) -> list[Finding]:
    return [src.at("ok", "auto data", c, f"{code(c)}: whether it shuffles is decided when it "
                   "runs (the source does not show it): split over the processes if it shuffles "
                   "then, whole on every process if not")
            for c in _loaders(src) if _shuffle(src, c) is None and kw(c, "batch_sampler") is None]


# --- the refusals a source shows ------------------------------------------------------------------

def _refusals(src: Source, nproc: int, mode: str) -> Iterator[tuple[ast.AST, str]]:
    for c in _loaders(src):
        if kw(c, "batch_sampler") is not None:
            yield c, ("a DataLoader with a batch_sampler of the script's own is refused when it "
                      "is built: --auto makes the batches itself; give it batch_size and "
                      "shuffle=True, or run without --auto")
        size = kw(c, "batch_size") or (c.args[1] if len(c.args) > 1 else None)
        if _shuffle(src, c) is True and mode == "global" and isinstance(const(size), int) \
                and const(size) % nproc:
            yield c, (f"batch_size={const(size)} is refused when this DataLoader is built: --auto "
                      f"splits it as the global batch over {nproc} processes; give a multiple of "
                      f"{nproc}, or --auto-batch per-gpu")
    for c in src.calls:
        name = src.qualname(c.func).rsplit(".", 1)[-1]
        if name == "WeightedRandomSampler" or (name == "RandomSampler" and (
                const(kw(c, "replacement")) is True or kw(c, "num_samples") is not None)):
            yield c, (f"{code(c)} draws with replacement: a shuffled DataLoader given it is "
                      "refused when it is built (an exact split has no meaning for it); use "
                      "shuffle=True, or run without --auto")
