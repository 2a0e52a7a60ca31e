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

Whatever sitecustomize the interpreter would have imported without this one runs after it.
"""
import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
from io import open as _open  # the real one: under --auto, ranks other than 0 write the script's
# files to copies of their own (multigpu.auto.files); these records are the harness's, not its

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
        with _open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def begin(self, dataset):
        """A new pass of the loader over `dataset`: the last one's record is written."""
        old = self.__dict__.get("_auto_public_record")
        key = _dataset_key(dataset)
        grad = torch.is_grad_enabled()
        if old is not None and not old["indices"] and (old["dataset"], old["grad"]) == (key, grad):
            return  # the same pass: a multi-worker iterator resets itself in its __init__
        if old is not None:
            flush(old, False)
        n = passes[(key, grad)] = passes.get((key, grad), -1) + 1
        record = {"dataset": key, "len": len(dataset), "grad": grad, "pass": n, "indices": []}
        self.__dict__["_auto_public_record"] = record
        self.__dict__["_auto_public_dataset"] = dataset
        open_records.append(record)

    def __init__(self, loader, *args, **kwargs):
        init(self, loader, *args, **kwargs)
        if "_auto_public_record" not in self.__dict__:  # no _reset during __init__ (torch 2.13)
            begin(self, loader.dataset)

    def _reset(self, loader=None, first_iter=False, *args, **kwargs):
        dataset = loader.dataset if loader is not None else self.__dict__.get(
            "_auto_public_dataset")
        if dataset is not None:
            begin(self, dataset)
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


_PATCHES = {}
if _FOLDER:
    _PATCHES["torch.utils.data.dataloader"] = _patch_dataloader
if os.environ.get("AUTO_PUBLIC_CIFAR_NO_MD5") == "1":
    _PATCHES["torchvision.datasets.cifar"] = _patch_cifar


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after its module executes, so that nothing is imported early."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute, patch = spec.loader.exec_module, _PATCHES.pop(name)

        def exec_module(module):
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _PATCHES:
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
