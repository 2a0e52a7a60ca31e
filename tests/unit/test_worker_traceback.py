"""The traceback a failing rank leaves for the launcher's report (its error file), from the worker
that runs a script under `multigpu run`: the script's frames alone, as `python script.py` prints
them; every frame with --debug, the worker's callers above it included."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "multiproc" / "scripts" / "raises_in_a_function.py"


def _reported(tmp_path, debug: bool) -> str:
    err = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(err)}
    env.pop("MULTIGPU_DEBUG", None)
    if debug:
        env["MULTIGPU_DEBUG"] = "1"
    done = subprocess.run([sys.executable, "-P", "-m", "multigpu.launcher.rank.worker", str(SCRIPT)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    return json.loads(err.read_text())["message"]


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_the_reported_traceback_starts_at_the_script_or_at_the_first_frame(tmp_path, debug):
    text = _reported(tmp_path, debug)
    frames = [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]
    assert text.splitlines()[-1] == "KeyError: 'missing-column'"
    assert frames[-2:] == [f'File "{SCRIPT}", line 8, in <module>',
                           f'File "{SCRIPT}", line 5, in load']
    if not debug:
        assert len(frames) == 2, text
    else:  # python -m: runpy's _run_module_as_main first, then the worker's own call of main
        assert frames[0].endswith("in _run_module_as_main"), text
        assert any("launcher/rank/worker.py" in f and f.endswith("in <module>") for f in frames), text


def test_a_keyboard_interrupt_the_script_raises_itself_is_its_error_not_a_stop(tmp_path):
    """No SIGINT came: the error is the script's, with its traceback on the console and in the
    report, exit 1 (a Ctrl-C's stop is exit 130 and one line of the launcher's)."""
    script = SCRIPT.with_name("raises_keyboard_interrupt.py")
    err = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(err)}
    env.pop("MULTIGPU_DEBUG", None)
    done = subprocess.run([sys.executable, "-P", "-m", "multigpu.launcher.rank.worker", str(script)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    said = done.stderr.splitlines()
    assert said[0] == "Traceback (most recent call last):", done.stderr
    assert said[-1] == "KeyboardInterrupt: cancelled by the script", done.stderr
    assert f'File "{script}", line 5, in cancel' in done.stderr
    assert json.loads(err.read_text())["message"].splitlines()[-1] == said[-1]
