"""The core install: `pip wheel` builds (a failure is the packaging regression this file is for),
the wheel carries the digits data, and `multigpu train` from it trains with the packages of the
extras and of the dev tools (scikit-learn, matplotlib, the loggers, the bench peers, torchvision,
timm) absent, trying to import none of them in any of its processes but matplotlib, through
extras.require, for its curves.png."""
import json
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.multiproc.conftest import REPO, cli_env

OPTIONAL = ("sklearn", "matplotlib", "wandb", "mlflow", "accelerate", "lightning",
            "pytorch_lightning", "torchvision", "timm")

# Loaded by every Python process of the run (the command, the workers) through PYTHONPATH: it
# notes the process, then makes each optional package absent, as in a light install, noting who
# tried to import it. The attempt is seen even where the import is wrapped in try/except
# ImportError, which would otherwise pass unseen. (A probe such as importlib.util.find_spec is not
# an attempt: the spec is given, only loading it fails.)
SITECUSTOMIZE = """
import importlib.abc, importlib.machinery, os, sys, traceback
_log = os.path.join({folder!r}, f"{{os.getpid()}}.txt")
with open(_log, "a") as f:
    f.write("started " + " ".join(sys.argv[:2]) + "\\n")

def _importer():
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not (frame.filename.startswith("<frozen") or "importlib" in frame.filename):
            return f"{{frame.filename}}:{{frame.lineno}}"

class _Absent(importlib.abc.Loader):
    def create_module(self, spec):
        with open(_log, "a") as f:
            f.write(f"imported {{spec.name}} by {{_importer()}}\\n")
        raise ModuleNotFoundError(f"No module named {{spec.name!r}}", name=spec.name)

    def exec_module(self, module):
        pass

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name in {optional!r}:
            return importlib.machinery.ModuleSpec(name, _Absent())

sys.meta_path.insert(0, _Block())
"""


def _wheel(tmp_path):
    """`pip wheel` of a copy of the project, offline (the dev extra brings setuptools): a failure
    here is the packaging regression this file exists for, not a reason to skip."""
    project = tmp_path / "project"  # a copy: setuptools leaves build/ and *.egg-info beside the source
    shutil.copytree(REPO / "src", project / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, project / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(tmp_path / "dist"), str(project)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, f"pip wheel failed: {done.stderr[-3000:]}"
    (wheel,) = (tmp_path / "dist").glob("multigpu-*.whl")
    return wheel


def _imports_seen(folder) -> dict[int, list[tuple[str, str]]]:
    """{pid: [(optional package, the file:line that tried to import it)]} of every process."""
    seen = {}
    for log in folder.glob("*.txt"):
        lines = log.read_text().splitlines()
        seen[int(log.stem)] = [tuple(line.split()[1::2]) for line in lines if line.startswith("imported ")]
    return seen


@pytest.mark.slow
def test_the_installed_wheel_trains_digits_importing_no_optional_package(tmp_path):
    wheel = _wheel(tmp_path)
    site, watched = tmp_path / "site", tmp_path / "imports"
    with zipfile.ZipFile(wheel) as zf:  # a pure-Python wheel installs by unpacking
        assert "multigpu/train/data/data_files/digits.npz" in zf.namelist()
        zf.extractall(site)
    hook = tmp_path / "hook"
    hook.mkdir()
    watched.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE.format(folder=str(watched), optional=OPTIONAL))
    env = cli_env()
    env["PYTHONPATH"] = f"{hook}:{site}"  # the unpacked wheel, not the source tree
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", "import sys, multigpu; print('multigpu from', multigpu.__file__, "
         "file=sys.stderr); from multigpu.cli import main; sys.exit(main(sys.argv[1:]))",
         "train", "--model", "mlp", "--data", "digits", "--epochs", "1", "--devices", "cpu:2",
         "--out", str(out)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"multigpu from {site / 'multigpu' / '__init__.py'}" in done.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [m for m in metrics if "val_samples" in m]
    assert epochs and epochs[-1]["val_samples"] == 355
    seen = _imports_seen(watched)
    assert len(seen) >= 3, ("the command and its 2 workers each noted", seen)
    ours = {(name, by.removeprefix(f"{site}/").split(":")[0])
            for tried in seen.values() for name, by in tried if by.startswith(f"{site}/")}
    # curves.png asks for matplotlib through extras.require, which names the extra when it is absent
    assert ours == {("matplotlib", "multigpu/core/system/extras.py")}, seen
    assert not (out / "curves.png").exists()


def test_bench_without_matplotlib_keeps_its_json_and_names_the_extra(tmp_path, monkeypatch):
    from multigpu.bench import runner

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    rep = {"notes": [], "rows": []}
    assert runner._plot(rep, tmp_path / "bench.png") is None
    assert rep["notes"] == ["no plot: the benchmark plot needs matplotlib, which is not installed: "
                            "pip install 'multigpu[bench]' (or pip install matplotlib)"]
    assert not (tmp_path / "bench.png").exists()
