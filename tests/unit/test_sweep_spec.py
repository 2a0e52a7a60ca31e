"""What a sweep runs: grids, include/exclude, names, each run's command line, its folder's lock."""
import subprocess
import sys
import textwrap

import pytest

from multigpu.cli.sweep_settings import parse_duration, split_rest
from multigpu.train.settings.configfile import read_mapping
from multigpu.core.errors import UsageError
from multigpu.sweep import pool as pools
from multigpu.sweep import spec as specs
from multigpu.sweep.state import SweepFolder, last_error_line

TRAIN = ["multigpu", "train", "--model", "lstm", "--data", "{data}", "--seq-length", "{seq_length}"]


def test_grid_expands_in_order_with_exclude_and_include():
    spec = specs.SweepSpec(TRAIN, {"data": ["timeseries:co2"], "seq_length": ["40", "60"],
                                   "future_length": ["1", "4"]},
                           include=[{"data": "timeseries:macro", "seq_length": 12, "future_length": 2}],
                           exclude=[{"seq_length": "60", "future_length": "4"}])
    specs.check(spec)
    runs = specs.expand(spec)
    assert [r.params for r in runs] == [
        {"data": "timeseries:co2", "seq_length": "40", "future_length": "1"},
        {"data": "timeseries:co2", "seq_length": "40", "future_length": "4"},
        {"data": "timeseries:co2", "seq_length": "60", "future_length": "1"},
        {"data": "timeseries:macro", "seq_length": 12, "future_length": 2}]
    assert runs[0].name == "data=timeseries-co2,seq_length=40,future_length=1"


def test_a_list_of_grids_is_their_union_without_repeats():
    spec = specs.SweepSpec(TRAIN, [{"data": ["a"], "seq_length": [40, 60]},
                                   {"data": ["b", "a"], "seq_length": [40]}])
    specs.check(spec)
    assert [(r.params["data"], r.params["seq_length"]) for r in specs.expand(spec)] == [
        ("a", 40), ("a", 60), ("b", 40)]


def test_train_command_gets_out_devices_resume_and_unplaced_keys_as_flags():
    spec = specs.SweepSpec(TRAIN, {"data": ["d x"], "seq_length": ["40"], "lr": ["0.01"]})
    specs.check(spec)
    run = specs.expand(spec)[0]
    argv = specs.argv_for(spec, run, {"out": "S/runs/n", "devices": "cpu:1", "port": "1", "resume": "S/runs/n"})
    assert argv[:2] == ["multigpu", "train"]
    assert argv[2:8] == ["--out", "S/runs/n", "--devices", "cpu:1", "--lr", "0.01"]
    assert argv[8:10] == ["--resume", "S/runs/n"]
    assert argv[-4:] == ["--data", "d x", "--seq-length", "40"]  # one argument, spaces and all


def test_placeholders_inside_arguments_and_builtins_for_any_command():
    spec = specs.SweepSpec(["python", "fit.py", "--lr={lr}", "--out", "{out}/x", "{port}", "{name}"],
                           {"lr": ["1e-3"]})
    specs.check(spec)
    run = specs.expand(spec)[0]
    assert specs.argv_for(spec, run, {"out": "O", "devices": "1", "port": "555"}) == [
        "python", "fit.py", "--lr=1e-3", "--out", "O/x", "555", "lr=1e-3"]


def test_multigpu_run_gets_devices_before_the_script():
    spec = specs.SweepSpec(["multigpu", "run", "fit.py", "--devices", "{lr}"], {"lr": ["1"]})
    specs.check(spec)  # --devices after the script is the script's own
    argv = specs.argv_for(spec, specs.expand(spec)[0], {"out": "O", "devices": "2", "port": "1"})
    assert argv == ["multigpu", "run", "--devices", "2", "fit.py", "--devices", "1"]


@pytest.mark.parametrize("command, grid, message", [
    (["python", "x.py", "{lr}"], {"lr2": [1]}, "uses {lr}, which is not a grid key"),
    (["python", "x.py"], {"lr": [1]}, "grid key 'lr' is not used in the command; add {lr}"),
    (TRAIN + ["--out", "x"], {"data": [1], "seq_length": [1]}, "the command sets --out"),
    (TRAIN + ["--devices=2"], {"data": [1], "seq_length": [1]}, "the command sets --devices"),
    (TRAIN, {"data": [1, 1], "seq_length": [1]}, "lists a value twice"),
    (TRAIN, {"data": [1], "seq_length": [], }, "has no values"),
    (["python", "x.py", "{out}"], {"out": [1]}, "grid key 'out'"),
    ([], {"lr": [1]}, "no command to sweep"),
    (TRAIN + ["--lr", "0.1"], {"data": [1], "seq_length": [1], "lr": [1, 2]},
     "the command sets --lr itself while the grid sweeps lr"),
])
def test_mistakes_are_one_line_with_the_fix(command, grid, message):
    with pytest.raises(UsageError, match=message.replace("{", r"\{").replace("}", r"\}")):
        specs.check(specs.SweepSpec(command, grid))


def test_an_exclude_that_names_no_grid_key_is_refused():
    spec = specs.SweepSpec(TRAIN, {"data": [1], "seq_length": [1]}, exclude=[{"seq_lenght": 1}])
    with pytest.raises(UsageError, match="'seq_lenght' is not a grid key"):
        specs.check(spec)


def test_train_runs_get_the_sweeps_min_free_memory():
    spec = specs.SweepSpec(TRAIN, {"data": ["d"], "seq_length": ["1"]})
    argv = specs.argv_for(spec, specs.expand(spec)[0],
                          {"out": "O", "devices": "1", "port": "1", "min_free_memory": "0"})
    assert argv[2:8] == ["--out", "O", "--devices", "1", "--min-free-memory", "0"]


def test_yaml_file_with_crlf_and_bom(tmp_path):
    text = textwrap.dedent("""\
        command: multigpu train --model lstm --data {data} --seq-length {seq_length}
        grid:
          data: [timeseries:co2]
          seq_length: [40, 60]
        exclude:
          - {seq_length: 60}
        max_parallel: 2
        """).replace("\n", "\r\n")
    path = tmp_path / "sweep.yaml"
    path.write_bytes("\ufeff".encode() + text.encode())
    spec, options = specs.from_mapping(read_mapping(str(path)), str(path))
    specs.check(spec)
    assert spec.command == TRAIN
    assert [r.params for r in specs.expand(spec)] == [{"data": "timeseries:co2", "seq_length": 40}]
    assert options == {"max_parallel": 2}


def test_rest_splits_file_and_command():
    assert split_rest(["--", "python", "x.py", "--grid", "z"]) == (None, ["python", "x.py", "--grid", "z"])
    assert split_rest(["s.yaml"]) == ("s.yaml", [])
    assert split_rest(["s.yml", "--", "python", "x.py"]) == ("s.yml", ["python", "x.py"])
    assert split_rest(["python", "x.py"]) == (None, ["python", "x.py"])
    with pytest.raises(UsageError, match="put options before the sweep file"):
        split_rest(["s.yaml", "--max-parallel", "2"])


def test_durations_and_devices_per_run():
    assert [parse_duration(t) for t in ("90", "90s", "30m", "2h", None)] == [90, 90, 1800, 7200, None]
    with pytest.raises(UsageError, match="like 90s"):
        parse_duration("soon")
    assert pools.parse_per_run("cpu:2") == ("cpu", 2) and pools.parse_per_run("4") == ("cuda", 4)
    with pytest.raises(UsageError, match="at least 1"):
        pools.parse_per_run("0")


def test_cpu_pool_takes_disjoint_cores_and_refuses_too_many(monkeypatch, tmp_path):
    monkeypatch.setenv("MULTIGPU_LEASE_DIR", str(tmp_path))
    pool = pools.make_pool("cpu:1", "cpu:1")
    units, lease = pool.take("test")
    assert len(units) == 1 and pool.take("test") is None  # the only core is in use
    assert pool.environment(units)["CUDA_VISIBLE_DEVICES"] == ""
    lease.release()
    pool.give_back(units)
    assert pool.take("test") is not None
    with pytest.raises(UsageError, match="asks for 99 CPU cores a run"):
        pools.make_pool("auto", "cpu:99")
    with pytest.raises(UsageError, match="names GPUs"):
        pools.make_pool("0,1", "cpu:1")


def test_folder_lock_is_exclusive_across_processes_and_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from multigpu.sweep.state import SweepFolder
        assert SweepFolder({str(tmp_path)!r}).lock()
        print("locked", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        folder = SweepFolder(tmp_path)
        assert folder.holder_pid() == holder.pid
        assert not folder.lock()
    finally:
        holder.kill()
        holder.wait()
    assert folder.holder_pid() is None
    assert folder.lock()
    folder.unlock()


def test_the_error_line_of_a_log_tail():
    tail = "epoch 1\nTraceback (most recent call last):\n  File x\nValueError: lr must be positive\n[exit]"
    assert last_error_line(tail) == "ValueError: lr must be positive"
    assert last_error_line("multigpu: error: --lr -1 must be more than 0\n") == \
        "multigpu: error: --lr -1 must be more than 0"


def test_a_program_that_does_not_exist_is_refused_once(tmp_path, capsys):
    from multigpu import cli
    from multigpu.cli.sweep_settings import check_program

    check_program(sys.executable)
    check_program("multigpu")
    # the sweep says it once, before any of its 3 runs starts or its folder is made
    argv = ["sweep", "--grid", "lr=1,2,3", "--devices", "cpu:1", "--out", str(tmp_path / "sw"),
            "--", "pyhton", "fit.py", "{lr}"]
    assert cli.main(argv) == 2
    assert capsys.readouterr() == ("", "multigpu: error: the command's program 'pyhton' is not "
                                   "found on PATH; check its spelling, or give its path (e.g. "
                                   "python3, ./train.sh)\n")
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_file_says_on_slurm_and_its_settings(tmp_path):
    """`on: slurm` is the boolean True to YAML 1.1; it still reaches the options as `on`."""
    path = tmp_path / "s.yaml"
    path.write_text("command: multigpu train --model mlp\ngrid: {lr: [1, 2]}\non: slurm\n"
                    "time: 4h\nslurm_arg: {account: abc}\n")
    _, options = specs.from_mapping(read_mapping(str(path)), str(path))
    assert options == {"on": "slurm", "time": "4h", "slurm_arg": {"account": "abc"}}


def test_slurm_settings_become_sbatch_options():
    from multigpu.sweep.slurm import SlurmSettings, parse_slurm_args

    extra = parse_slurm_args(["account=abc", "cpus_per_task=8", "exclusive", "licenses=fs:1"])
    params = SlurmSettings("2", 4 * 3600, "gpu", extra, max_parallel=3).parameters(18)
    assert (params["gpus_per_node"], params["cpus_per_task"], params["time"]) == (2, "8", 240)
    assert (params["partition"], params["array_parallelism"], params["use_srun"]) == ("gpu", 3, False)
    assert (params["account"], params["exclusive"]) == ("abc", True)  # submitit's own names
    assert params["additional_parameters"] == {"requeue": True, "licenses": "fs:1",
                                               "signal": "B:USR1@90"}
    assert SlurmSettings("cpu:4").parameters(2)["cpus_per_task"] == 4
    with pytest.raises(UsageError, match=r"^--slurm-arg '=x': give sbatch's option as NAME=VALUE"):
        parse_slurm_args(["=x"])
    with pytest.raises(UsageError, match=r"^--slurm-arg signal: the sweep sets it itself"):
        SlurmSettings("1", extra={"signal": "USR2@60"}).parameters(2)


def test_runs_of_several_nodes_are_jobs_of_a_task_a_node_that_srun_starts(tmp_path):
    """--nodes-per-run 2: the sbatch script submitit writes asks for 2 nodes, one task each,
    starts Python on each through srun (no `exec`: srun would not find it), and SIGUSR2 goes to
    the step (no B:: the batch shell is not the task any more; not SIGUSR1, which SLURM would
    give every rank besides its launcher). One node keeps the batch shell's own Python and
    B:USR1."""
    pytest.importorskip("submitit")
    from submitit.slurm.slurm import _make_sbatch_string

    from multigpu.sweep.slurm import SlurmSettings

    two = SlurmSettings("cpu:1", 600, nodes=2)
    params = two.parameters(2)
    assert (params["nodes"], params["ntasks_per_node"], params["use_srun"]) == (2, 1, True)
    assert params["additional_parameters"]["signal"] == "USR2@90"
    assert params["setup"] == ["export SUBMITIT_PREEMPT_SIGNAL=USR2"]
    assert two.describe() == "each run 2 nodes, 1 CPU core each, time limit 10m 00s"
    script = _make_sbatch_string(command="/venv/python -u -m submitit.core._submit F",
                                 folder=str(tmp_path), **params)
    lines = script.splitlines()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --signal=USR2@90",
                 "#SBATCH --cpus-per-task=1", "#SBATCH --requeue"):
        assert line in lines, script
    command = [ln for ln in lines if "submitit.core._submit" in ln]
    assert len(command) == 1 and command[0].startswith("srun --unbuffered ") and command[0].endswith(
        " /venv/python -u -m submitit.core._submit F"), script
    one = SlurmSettings("cpu:1", 600).parameters(2)
    assert (one["nodes"], one["use_srun"], one["additional_parameters"]["signal"]) == (1, False, "B:USR1@90")
    for key in ("nodes", "ntasks-per-node", "ntasks"):
        with pytest.raises(UsageError, match=rf"^--slurm-arg {key}: each run is a job of "
                                             r"--nodes-per-run nodes \(default 1\), one task a node; "
                                             r"give --nodes-per-run N instead$"):
            SlurmSettings("1", extra={key: "3"}).parameters(2)


def test_every_node_of_a_run_meets_at_one_port_from_the_job_id(monkeypatch):
    """The port is the same on every node without a word between them (the job's id), another
    for each job, and reaches train and run as --master-port (and {port})."""
    from multigpu.sweep.slurm_task import node_rank, shared_port

    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert (shared_port(), node_rank(2), node_rank(1)) == (18456, 1, 0)
    monkeypatch.setenv("SLURM_JOB_ID", "123457")
    assert shared_port() == 18457
    run = specs.Run("lr=1", {"lr": 1})
    values = {"out": "O", "devices": "cpu:1", "port": "18457", "master_port": "18457"}
    train = specs.SweepSpec(["multigpu", "train", "--model", "mlp"], {"lr": [1]})
    assert specs.argv_for(train, run, values)[:9] == [
        "multigpu", "train", "--out", "O", "--devices", "cpu:1", "--master-port", "18457", "--lr"]
    launch = specs.SweepSpec(["multigpu", "run", "t.py", "--p", "{port}"], {"lr": [1]})
    assert specs.argv_for(launch, run, values) == [
        "multigpu", "run", "--devices", "cpu:1", "--master-port", "18457", "t.py", "--p", "18457"]


@pytest.mark.parametrize("text, message", [
    ("comand: multigpu train --model mlp\ngrid: {lr: [0.1]}\n",
     "s.yaml: unknown setting 'comand'; did you mean 'command'?"),
    ("command: multigpu train --model mlp\ngrid: {lr: [0.1]}\nmax_paralel: 2\n",
     "s.yaml: unknown setting 'max_paralel'; did you mean 'max_parallel'?"),
    ("command: multigpu train --model mlp\ngrid: {lr: [0.1]}\nzzz: 2\n",
     "s.yaml: unknown setting 'zzz'; a sweep file holds command, grid, include, exclude and "
     "devices, devices_per_run, runs_per_gpu,"),
    ("command: multigpu train --model mlp\ngrid:\n  lr: [{a: 1}, 0.01]\n",
     "s.yaml: grid key 'lr': {'a': 1} is not a value; give a list of numbers or words, "
     "e.g. lr: [0.001, 0.01]"),
    ("command: multigpu train --model mlp\ngrid:\n  lr: [[0.1, 0.01]]\n",
     "s.yaml: grid key 'lr': [0.1, 0.01] is not a value; give a list of numbers or words"),
    ("command: multigpu train --model mlp\ngrid:\n  lr:\n",
     "s.yaml: grid key 'lr' has no values; give a list, e.g. lr: [0.001, 0.01]"),
    ("", "sweep file s.yaml is empty; write one setting per line, e.g. `command: multigpu train "
         "--model cnn --lr {lr}`\n"),
    (None, "sweep file s.yaml: no such file; give the path of a YAML or JSON file, e.g. "
           "multigpu sweep sweep.yaml\n"),
])
def test_a_sweep_file_mistake_is_named_before_any_run(tmp_path, monkeypatch, capsys, text, message):
    """A misspelt key is named as such (not as a missing `command:`), with the close name; a
    grid value that is a mapping, a list or empty is refused instead of run as its text; a
    missing or empty file is shown how a sweep file is given (not train's --config)."""
    from multigpu import cli

    monkeypatch.chdir(tmp_path)
    if text is not None:
        (tmp_path / "s.yaml").write_text(text)
    assert cli.main(["sweep", "--dry-run", "s.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"multigpu: error: {message}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["s.yaml"] if text is not None else [])
