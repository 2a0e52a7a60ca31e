"""Put on PYTHONPATH by benchmarks/auto_public_scripts.py for every run it starts (one-GPU and
--auto alike): records which dataset indices each process's DataLoaders fetch, per pass, without
editing the script. Active only where AUTO_PUBLIC_RECORD names a folder.

Where: `_BaseDataLoaderIter._next_index`, in the process that runs the loop; what it returns is
exactly what the fetcher then asks the dataset's __getitem__ for (in that process, or in a
loader worker). A pass starts with a new iterator, or at its `_reset` (a persistent-workers loader
reused) and is written, one JSON line, when the sampler is exhausted or at exit (then
marked incomplete). Lines go to `<folder>/samples-rank<RANK>-<pid>.jsonl`.

One shim, said in the results: AUTO_PUBLIC_CIFAR_NO_MD5=1 makes torchvision's CIFAR10 check that
its files (batches, batches.meta) exist instead of checking their md5 against the real archive's (the generated
batches differ, and the script's download=True would otherwise try the network).

What else each process records, for the corpus (benchmarks/auto_corpus.py), in
`<folder>/events-rank<RANK>-<pid>.jsonl`, one JSON line each, written as it happens:
- every file opened for writing (the audit hook's `open` event: builtins.open, os.open, so
  PIL, numpy, matplotlib, shutil, tensorboard alike) and every rename (`os.rename`: os.replace
  too), and each `torch.save` to a path (torch writes those from C++, past the audit hook);
- the first optimizer step (torch.optim's global step hook), and at exit the number of steps;
- at exit, a hash of the parameters of every module that ran a forward (torch's global forward
  hook keeps them), of every optimizer's parameters, so the ranks' weights can be compared.

A second shim, said in the results: where torchvision's compiled ops cannot load (PyPI's Linux
torchvision is a CUDA build, beside a CPU torch it finds no libtorch_cuda), torchvision 0.28's
import fails on its own fake-kernel registration for `torchvision::nms`; the two schemas it
registers (nms, qnms) are defined first, without kernels. Nothing the corpus runs calls them.

Whatever sitecustomize the interpreter would have imported without this one runs after it.
"""
import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
from io import open as _open  # the real one: under --auto, ranks other than 0 write the script's
# files to copies of their own (multigpu.auto.writes.files); these records are the harness's, not its

_FOLDER = os.environ.get("AUTO_PUBLIC_RECORD")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _dataset_key(dataset):
    root = getattr(dataset, "root", "")
    train = getattr(dataset, "train", None)
    return f"{type(dataset).__name__}|{os.path.basename(os.path.normpath(str(root)))}|{train}"


def _patch_dataloader(module):
    import torch

    base = module._BaseDataLoaderIter
    init, reset, next_index = base.__init__, base._reset, base._next_index
    owner, passes, open_records = os.getpid(), {}, []
    rank = os.environ.get("RANK", "0")
    path = os.path.join(_FOLDER, f"samples-rank{rank}-{owner}.jsonl")

    def flush(record, complete):
        if record.get("written") or os.getpid() != owner:
            return
        record["written"] = True
        line = {k: v for k, v in record.items() if k != "written"} | {"complete": complete}
        with _open(path, "a") as f:  # noqa: UP020 (builtins.open is --auto's patch by now)
            f.write(json.dumps(line) + "\n")

    def begin(self, dataset, sampler=None):
        """A new pass of the loader over `dataset`: the last one's record is written."""
        old = self.__dict__.get("_auto_public_record")
        key = _dataset_key(dataset)
        grad = torch.is_grad_enabled()
        if old is not None and not old["indices"] and (old["dataset"], old["grad"]) == (key, grad):
            return  # the same pass: a multi-worker iterator resets itself in its __init__
        if old is not None:
            flush(old, False)
        n = passes[(key, grad)] = passes.get((key, grad), -1) + 1
        record = {"dataset": key, "len": len(dataset), "grad": grad, "pass": n, "indices": [],
                  "sampler": type(sampler).__name__ if sampler is not None else None}
        self.__dict__["_auto_public_record"] = record
        self.__dict__["_auto_public_dataset"] = dataset
        open_records.append(record)

    def __init__(self, loader, *args, **kwargs):
        init(self, loader, *args, **kwargs)
        if "_auto_public_record" not in self.__dict__:  # no _reset during __init__ (torch 2.13)
            begin(self, loader.dataset, loader.sampler)

    def _reset(self, loader=None, first_iter=False, *args, **kwargs):
        dataset = loader.dataset if loader is not None else self.__dict__.get(
            "_auto_public_dataset")
        if dataset is not None:
            begin(self, dataset, loader.sampler if loader is not None else None)
        if loader is None:
            return reset(self, *args, **kwargs)
        return reset(self, loader, first_iter, *args, **kwargs)

    def _next_index(self):
        record = self.__dict__.get("_auto_public_record")
        try:
            index = next_index(self)
        except StopIteration:
            if record is not None:
                flush(record, True)
            raise
        if record is not None:
            record["indices"].extend(index if isinstance(index, list) else [index])
        return index

    base.__init__, base._reset, base._next_index = __init__, _reset, _next_index
    atexit.register(lambda: [flush(r, False) for r in open_records])


def _patch_cifar(module):
    """torchvision.datasets.cifar's own check_integrity (the batches' and batches.meta's md5):
    a file that exists passes."""
    module.check_integrity = lambda fpath, md5=None: os.path.isfile(fpath)


_EVENTS = {}


def _event(kind, **fields):
    """One line to this process's events file, at once (a killed rank keeps what it did)."""
    if "fd" not in _EVENTS:
        rank, pid = os.environ.get("RANK", "0"), os.getpid()
        path = os.path.join(_FOLDER, f"events-rank{rank}-{pid}.jsonl")
        _EVENTS["busy"] = True
        try:
            _EVENTS["fd"] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        finally:
            _EVENTS["busy"] = False
        # first: which process this is (the launcher of `multigpu run` records too)
        os.write(_EVENTS["fd"], (json.dumps({"kind": "process", "argv": sys.orig_argv,
                                             "pid": pid, "ppid": os.getppid()}) + "\n").encode())
    os.write(_EVENTS["fd"], (json.dumps({"kind": kind} | fields) + "\n").encode())


def _writes(event, args):
    """The audit hook: files opened for writing, renames. Reads and our own files are skipped."""
    if _EVENTS.get("busy") or event not in ("open", "os.rename"):
        return
    if event == "open":
        path, mode, flags = args
        writing = (any(c in mode for c in "wax+") if isinstance(mode, str)
                   else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
        if not writing or not isinstance(path, (str, bytes, os.PathLike)):
            return
        _event("write", path=os.path.abspath(os.fsdecode(path)), how="open")
    else:
        src, dst = args[0], args[1]
        _event("rename", src=os.path.abspath(os.fsdecode(src)), dst=os.path.abspath(os.fsdecode(dst)))


def _patch_serialization(module):
    """torch.save to a path: C++ writes the file, past the audit hook; recorded here."""
    save = module.save

    def recorded_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            _event("write", path=os.path.abspath(os.fsdecode(f)), how="torch.save")
        return save(obj, f, *args, **kwargs)

    recorded_save.__wrapped__ = save
    module.save = recorded_save


def _patch_optim(module):
    """Optimizer steps counted (torch's global hook, public), their optimizers kept for the
    weights' hash at exit; modules that run a forward kept alike."""
    import torch

    steps, kept = [0], {}

    def after_step(optimizer, args, kwargs):
        steps[0] += 1
        kept.setdefault(id(optimizer), optimizer)
        if steps[0] == 1:
            _event("first_step")

    def after_forward(mod, args, output):
        if id(mod) not in kept and next(mod.parameters(recurse=False), None) is not None:
            kept[id(mod)] = mod

    module.register_optimizer_step_post_hook(after_step)
    torch.nn.modules.module.register_module_forward_hook(after_forward)
    atexit.register(lambda: _weights(steps[0], list(kept.values())))


def _weights(steps, kept):
    """At exit: the step count and one hash per optimizer's and per module's own parameters."""
    import hashlib

    import torch

    hashes = []
    for obj in kept:
        if isinstance(obj, torch.optim.Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            what = f"optimizer:{type(obj).__name__}"
        else:
            params = list(obj.parameters(recurse=False))
            what = f"module:{type(obj).__name__}"
        digest = hashlib.sha1()
        for p in params:
            digest.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        hashes.append([what, sum(p.numel() for p in params), digest.hexdigest()])
    _event("exit", steps=steps, weights=sorted(hashes))


def _stub_torchvision_ops(spec):
    """Before torchvision runs: where its compiled ops do not load, the schemas its import
    registers fake kernels for, defined without kernels (see this file's docstring)."""
    import glob

    import torch

    found = glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so"))
    try:
        if found:
            torch.ops.load_library(found[0])
            return
    except OSError:
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _EVENTS["torchvision_lib"] = lib  # a Library dropped would remove its definitions
    if _FOLDER:
        _event("shim", what="torchvision ops stubbed: its compiled ops did not load")


_PATCHES, _BEFORE = {}, {"torchvision": _stub_torchvision_ops}
if _FOLDER:
    _PATCHES["torch.utils.data.dataloader"] = _patch_dataloader
    _PATCHES["torch.serialization"] = _patch_serialization
    _PATCHES["torch.optim.optimizer"] = _patch_optim
    sys.addaudithook(_writes)
if os.environ.get("AUTO_PUBLIC_CIFAR_NO_MD5") == "1":
    _PATCHES["torchvision.datasets.cifar"] = _patch_cifar


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after its module executes, so that nothing is imported early."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES and name not in _BEFORE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module
        patch, before = _PATCHES.pop(name, None), _BEFORE.pop(name, None)

        def exec_module(module):
            if before is not None:
                before(spec)
            execute(module)
            if patch is not None:
                patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())


def _chain():
    """The sitecustomize this file shadows (a distribution's own), if any."""
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") != _HERE and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain()
