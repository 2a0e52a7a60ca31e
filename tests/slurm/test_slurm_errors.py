"""`multigpu sweep --on slurm` where it cannot submit: one line that says why and what to do,
exit 2, and no sweep folder left behind. No SLURM is started: these are the machines without."""
import shutil
import subprocess
import sys

import pytest

from tests.multiproc.conftest import cli_env

COMMAND = ["--on", "slurm", "--devices-per-run", "cpu:1", "--grid", "lr=0.003,0.01", "--out", "sw",
           "--", "multigpu", "train", "--model", "mlp", "--data", "digits"]


def sweep(tmp_path, env, *extra):
    return subprocess.run([sys.executable, "-m", "multigpu", "sweep", *extra, *COMMAND],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def assert_refused(proc, tmp_path, message: str) -> None:
    """Exit 2, `message` as the one line on stderr, and no sweep folder left."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == message
    assert not (tmp_path / "sw").exists()


def test_without_submitit_it_names_the_extra(tmp_path):
    shadow = tmp_path / "shadow" / "submitit"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named submitit')\n")
    env = cli_env()
    env["PYTHONPATH"] = f"{tmp_path / 'shadow'}:{env['PYTHONPATH']}"
    proc = sweep(tmp_path, env)
    assert_refused(proc, tmp_path, ("multigpu: error: multigpu sweep --on slurm needs submitit, "
                                    "which is not installed: pip install 'multigpu[slurm]' (or pip "
                                    "install submitit)"))


def test_without_sbatch_it_says_where_to_submit_from(tmp_path):
    proc = sweep(tmp_path, {**cli_env(), "PATH": str(tmp_path / "empty")})
    assert_refused(proc, tmp_path, ("multigpu: error: --on slurm: sbatch is not on PATH; submit "
                                    "from a machine of the SLURM cluster (a login node), or leave "
                                    "out --on slurm to run the sweep here"))


def test_runs_per_gpu_is_refused_on_slurm(tmp_path):
    proc = sweep(tmp_path, cli_env(), "--runs-per-gpu", "4")
    assert_refused(proc, tmp_path, ("multigpu: error: --runs-per-gpu packs runs onto this "
                                    "machine's GPUs; on SLURM each run is a job of its own: leave "
                                    "it out, or run the sweep here without --on slurm"))


def test_sbatch_without_a_slurm_configuration_says_where_to_submit_from(tmp_path):
    """sbatch installed on a machine that is not part of a cluster (an empty slurm.conf here;
    none at all gives another fatal line, said the same way): one line that says so, and the
    sweep folder the failed submission began is gone."""
    if shutil.which("sbatch") is None:
        pytest.skip("sbatch is not installed (Debian: apt-get install slurm-wlm)")
    conf = tmp_path / "empty.conf"
    conf.write_text("")
    proc = sweep(tmp_path, {**cli_env(), "SLURM_CONF": str(conf)})
    assert_refused(proc, tmp_path, ("multigpu: error: --on slurm: sbatch finds no SLURM cluster "
                                    "from here (Unable to process configuration file); submit from "
                                    "a login node of the cluster (or set SLURM_CONF to its "
                                    "slurm.conf), or leave out --on slurm to run the sweep here"))


def test_nodes_per_run_without_slurm_or_below_one_is_refused(tmp_path):
    """This machine is one node: --nodes-per-run (flag or sweep file) without --on slurm is one
    line, as is a count below 1 with it; no sweep folder is made."""
    local = [a for a in COMMAND if a not in ("--on", "slurm")]
    proc = subprocess.run([sys.executable, "-m", "multigpu", "sweep", "--nodes-per-run", "2",
                           *local], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                          timeout=120)
    assert_refused(proc, tmp_path, ("multigpu: error: --nodes-per-run 2: runs of several nodes go "
                                    "through SLURM, and this sweep runs on this one machine; add "
                                    "--on slurm, or leave --nodes-per-run out"))
    (tmp_path / "s.yaml").write_text("command: multigpu train --model mlp --data digits\n"
                                     "grid: {lr: [0.1]}\nnodes_per_run: 4\nout: sw\n")
    proc = subprocess.run([sys.executable, "-m", "multigpu", "sweep", "s.yaml"], cwd=tmp_path,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert_refused(proc, tmp_path, ("multigpu: error: --nodes-per-run 4: runs of several nodes go "
                                    "through SLURM, and this sweep runs on this one machine; add "
                                    "--on slurm, or leave --nodes-per-run out"))
    proc = sweep(tmp_path, cli_env(), "--nodes-per-run", "0")
    assert_refused(proc, tmp_path, ("multigpu: error: --nodes-per-run 0: give a whole number of at "
                                    "least 1, e.g. --nodes-per-run 1"))
