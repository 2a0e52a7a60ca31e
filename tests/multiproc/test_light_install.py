"""The core install: the wheel carries the digits data, and training needs neither scikit-learn
nor matplotlib (they come with extras)."""
import json
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.multiproc.conftest import REPO, cli_env

# Run the CLI with the optional packages made unimportable: `import sklearn` then raises
# ImportError, as it does where they are not installed.
BLOCKED_MAIN = """
import sys
sys.modules["sklearn"] = sys.modules["matplotlib"] = None
import multigpu
print("multigpu from", multigpu.__file__, file=sys.stderr)
from multigpu.cli import main
code = main(sys.argv[1:])
assert "sklearn" not in sys.modules or sys.modules["sklearn"] is None
sys.exit(code)
"""


def _wheel(tmp_path):
    pytest.importorskip("setuptools")
    project = tmp_path / "project"  # a copy: setuptools leaves build/ and *.egg-info beside the source
    shutil.copytree(REPO / "src", project / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, project / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path / "dist"), str(project)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    if done.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {done.stderr[-300:]}")
    (wheel,) = (tmp_path / "dist").glob("multigpu-*.whl")
    return wheel


@pytest.mark.slow
def test_the_installed_wheel_trains_digits_without_sklearn_or_matplotlib(tmp_path):
    wheel = _wheel(tmp_path)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:  # a pure-Python wheel installs by unpacking
        assert "multigpu/data_files/digits.npz" in zf.namelist()
        zf.extractall(site)
    env = cli_env()
    env["PYTHONPATH"] = str(site)  # the unpacked wheel, not the source tree
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED_MAIN, "train", "--model", "mlp", "--data", "digits",
         "--epochs", "1", "--devices", "cpu:1", "--out", str(out)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [m for m in metrics if "val_samples" in m]
    assert epochs and epochs[-1]["val_samples"] == 355
    assert f"multigpu from {site / 'multigpu' / '__init__.py'}" in done.stderr


def test_bench_without_matplotlib_keeps_its_json_and_names_the_extra(tmp_path, monkeypatch):
    from multigpu.bench import runner

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    rep = {"notes": [], "rows": []}
    assert runner._plot(rep, tmp_path / "bench.png") is None
    assert rep["notes"] == ["no plot: the benchmark plot needs matplotlib, which is not installed: "
                            "pip install 'multigpu[bench]' (or pip install matplotlib)"]
    assert not (tmp_path / "bench.png").exists()
