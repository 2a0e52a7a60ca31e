"""Scripts written for other libraries under `multigpu run` on CPU processes: one job of N
processes, as on GPUs, not N separate single-process jobs. The libraries are not dependencies of
multigpu; the dev extra brings them, so a missing one fails here rather than skipping."""
import importlib
import json

import pytest

from .conftest import multigpu

pytestmark = pytest.mark.slow
SCRIPTS = __import__("pathlib").Path(__file__).parent / "scripts"


@pytest.mark.parametrize("library,script,kind", [
    ("accelerate", "foreign_accelerate.py", "DistributedType.MULTI_CPU"),
    # lightning takes about 20 s to import on 2 busy cores: CI runs it (make test-all)
    pytest.param("lightning", "foreign_fabric.py", "DDPStrategy", marks=pytest.mark.extended),
])
def test_an_accelerate_or_fabric_script_on_two_cpu_processes_sees_both(tmp_path, library, script, kind):
    importlib.import_module(library)
    proc = multigpu("run", "--devices", "cpu:2", SCRIPTS / script, tmp_path, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen == [{"world": 2, "type": kind, "sum": 3.0}] * 2
