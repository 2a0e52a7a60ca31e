"""The CLI answers --help and usage errors without importing torch (it takes ~1.5 s to import).

Each case runs in a fresh interpreter, since this test process has torch loaded already. Speed
itself is measured by benchmarks/cli_startup.py, not asserted here.
"""
import json
import os
import subprocess
import sys
import time

import pytest

HEAVY = ("torch", "numpy", "sklearn", "matplotlib")

PROBE = """
import json, sys
from multigpu.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "loaded": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)  # noqa: UP031 (the probe's dict braces would need doubling in an f-string)


def _probe(*argv: str) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                          timeout=60)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["run", "--help"],
                                  ["bench", "--help"], ["gpus", "--help"], ["env", "--help"],
                                  ["plot", "--help"], ["export", "--help"], ["pack", "--help"]])
def test_help_imports_no_heavy_module(argv):
    result, _ = _probe(*argv)
    assert result == {"code": 0, "loaded": []}


@pytest.mark.parametrize("argv, message", [
    (["train", "--model", "mlp", "--epochs", "0"], "--epochs 0 must be a number at least 1"),
    (["train", "--model", "nope"], "unknown model 'nope'"),
    (["train", "--model", "mlp", "--checkpoint-every", "xx"], "--checkpoint-every xx"),
    (["train", "--model", "mlp", "--devices", "cpu:0"], "--devices cpu:0"),
    (["train", "--model", "mlp", "--compile", "reduce-overhead", "--devices", "cpu:1"],
     "records CUDA graphs, which need GPUs"),
    (["gpus", "--bogus"], "multigpu gpus has no option --bogus"),
    (["train", "--model", "mlp", "--logger", "tb"], "'tb' is not a logger"),
    (["train", "--model", "mlp", "--log-every", "0"], "--log-every 0 must be a number at least 1"),
    (["plot", "no-such-run"], "no-such-run does not exist"),
    (["bench", "--model", "mlp", "--batch-size", "x"], "--batch-size 'x'"),
])
def test_usage_errors_import_no_heavy_module(argv, message):
    result, stderr = _probe(*argv)
    assert result == {"code": 2, "loaded": []}
    assert message in stderr and "Traceback" not in stderr


def test_package_exports_load_on_first_use():
    code = ("import sys, multigpu; before = 'torch' in sys.modules; "
            "from multigpu import setup, Accuracy; import multigpu.core.runtime as r; "
            "print(before, setup is r.setup, 'torch' in sys.modules, sorted(multigpu.__all__) "
            "== [n for n in dir(multigpu) if n in multigpu.__all__])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "True", "True", "True"], done.stderr


@pytest.mark.parametrize("argv, said", [
    (["train", "--model", "mlp", "--epochz", "3"], "multigpu train has no option --epochz; did you mean --epochs?"),
    (["train", "--model", "mlp", "--epochz=3"], "multigpu train has no option --epochz; did you mean --epochs?"),
    (["bench", "--bogus"], "multigpu bench has no option --bogus; multigpu bench --help lists them"),
    (["--bogus", "gpus"], "multigpu has no option --bogus; multigpu --help lists them"),
    (["doctor", "--auto", "-m", "mypkg.train"], "multigpu doctor: -m mypkg.train: a module to check "
     "goes after --, as a script does: multigpu doctor [--auto] -- -m mypkg.train ARGS; multigpu doctor "
     "--help lists the options"),
])
def test_an_unknown_option_is_named_with_the_nearest_real_one(argv, said, capsys):
    from multigpu import cli

    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"multigpu: error: {said}\n"


@pytest.mark.parametrize("typed, hint", [("trian", "; did you mean train?"), ("sweeep", "; did you mean sweep?"),
                                          ("xyzzy", "")])
def test_a_misspelt_command_is_named_with_the_nearest_real_one(typed, hint, capsys):
    from multigpu import cli

    with pytest.raises(SystemExit) as ended:
        cli.main([typed, "--help"])
    assert ended.value.code == 2
    assert capsys.readouterr().err == (
        f"multigpu: error: argument COMMAND: invalid choice: '{typed}' (choose from 'train', 'run', "
        f"'sweep', 'doctor', 'gpus', 'env', 'bench', 'plot', 'export', 'pack', 'test'){hint}; multigpu "
        "--help lists the options\n")


FORMS = ("digits, synthetic:N (e.g. synthetic:5000), folder:PATH (ImageFolder layout), "
         "shards:DIR (WebDataset tar shards), timeseries:CSV")


@pytest.mark.parametrize("spec, said", [
    ("./imgs", "unknown data spec './imgs': it is a folder; for images in its train/<class>/ and "
               f"val/<class>/ use --data folder:./imgs (the forms: {FORMS})"),
    ("./flat", "unknown data spec './flat': it is a folder, but --data folder:PATH reads images "
               "from PATH/train/<class>/ (and PATH/val/<class>/), and it has no train/ subfolder: "
               "move its class folders under ./flat/train/ (some images of each class under val/), "
               "then use --data folder:./flat"),
    ("series.csv", "unknown data spec 'series.csv': it is a file; for a numeric CSV (a time series) "
                   f"use --data timeseries:series.csv (the forms: {FORMS})"),
    ("/no/such/", "unknown data spec '/no/such/': no file or folder is there, and it is not one of "
                  f"the forms: {FORMS}"),
    ("mnist", f"unknown data spec 'mnist': use one of {FORMS}"),
])
def test_a_data_spec_of_no_form_is_one_line_before_any_launch(tmp_path, spec, said):
    """Refused in the launching process, before torch, a run folder or a worker: with cpu:2 the
    workers once found it, 4 s later, leaving runs/<time>-mlp-. behind."""
    (tmp_path / "imgs" / "train" / "cat").mkdir(parents=True)
    (tmp_path / "flat" / "cat").mkdir(parents=True)  # class folders with no train/ above them
    (tmp_path / "series.csv").write_text("a\n1\n2\n")
    before = sorted(tmp_path.rglob("*"))
    done = subprocess.run([sys.executable, "-c", PROBE, "train", "--model", "mlp", "--data", spec,
                           "--devices", "cpu:2"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"code": 2, "loaded": []}, done.stderr
    assert done.stderr == f"multigpu: error: {said}\n"
    assert sorted(tmp_path.rglob("*")) == before, "no run folder"


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`multigpu sweep --dry-run ... | head` where head has gone: no traceback, and the status a
    shell shows for a program that SIGPIPE ended (141), not 1. (argparse's --help is quiet
    already.)"""
    argv = ["sweep", "--dry-run", "--grid", "v=1,2,3", "--", "echo", "{v}"]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    done = subprocess.run([sys.executable, "-m", "multigpu", *argv], stdout=write,
                          stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=60)
    os.close(write)
    assert (done.returncode, done.stderr) == (141, "")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["atexit", "thread"])
def test_a_ctrl_c_while_the_program_ends_keeps_its_exit_code_without_a_traceback(where):
    """The second of two Ctrl-Cs often lands after the command has decided its exit code, while
    the interpreter ends (its atexit hooks, the threads it waits for: a logger's writer). Caused
    here by a SIGINT the process sends itself from there: the exit code stays, nothing printed."""
    late = ("import atexit; atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), "
            "time.sleep(0.3)))" if where == "atexit" else
            # SIGINT once the main thread is in cli's _end_now (the exit code decided); a sleep of
            # 0.5 s was not always enough on the loaded 2-core VM
            "def ending():\n"
            "    main = threading.main_thread().ident\n"
            "    while True:\n"
            "        frame, names = sys._current_frames().get(main), []\n"
            "        while frame is not None:\n"
            "            names.append(frame.f_code.co_name); frame = frame.f_back\n"
            "        if '_end_now' in names: break\n"
            "        time.sleep(0.01)\n"
            "    os.kill(os.getpid(), signal.SIGINT); time.sleep(0.3)\n"
            "threading.Thread(target=ending).start()")
    code = ("import os, signal, sys, threading, time\n" + late + "\n"
            "sys.argv = ['multigpu', 'gpus', '--help']\n"
            "import runpy; runpy.run_module('multigpu', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and done.stderr == "", done.stderr


@pytest.mark.parametrize("argv, code", [(["gpus"], 0), (["train", "--epochs", "0"], 2)])
def test_the_program_ends_with_its_code_after_every_thread_and_atexit_hook(tmp_path, argv, code):
    """cli.entry ends the process from its last atexit hook, without the interpreter's teardown:
    a thread that is not a daemon finishes, every other hook runs, the output is all there, and
    the exit code is the command's."""
    script = (
        "import atexit, os, sys, threading, time\n"
        f"out = {str(tmp_path)!r}\n"
        "sys.argv = ['multigpu', *sys.argv[1:]]\n"
        "from multigpu.cli import entry\n"
        "def later():\n"
        "    time.sleep(0.5)\n"
        "    open(os.path.join(out, 'thread'), 'w').write('done')\n"
        "threading.Thread(target=later).start()\n"
        "import torch\n"  # its own atexit hooks too
        "atexit.register(lambda: open(os.path.join(out, 'hook'), 'w').write('ran'))\n"
        "print('the last line', end='')\n"
        "entry()\n")
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == code, done.stderr
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "hook").read_text() == "ran"
    assert "the last line" in done.stdout


def test_an_error_a_ctrl_c_left_behind_is_the_ctrl_cs_stop(monkeypatch, capsys):
    """A Ctrl-C inside a C module's import (numpy's, while torch imports) can leave that module
    half made, and the next import fails instead of stopping: "ImportError: cannot load module
    more than once per process", a traceback and exit 1 (a Ctrl-C storm on the 2-core VM, 1 of
    12 tries). Caused here: a real SIGINT, caught where the import swallowed it, then that error."""
    import signal as signals

    from multigpu import cli
    from multigpu.cli import gpus

    def half_made_import(args):
        try:
            os.kill(os.getpid(), signals.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            pass
        raise ImportError("cannot load module more than once per process")

    monkeypatch.setattr(gpus, "main", half_made_import)
    monkeypatch.delenv("MULTIGPU_DEBUG", raising=False)
    assert cli.main(["gpus"]) == 130
    assert capsys.readouterr().err == "multigpu: interrupted\n"
    assert signals.getsignal(signals.SIGINT) is signals.default_int_handler
