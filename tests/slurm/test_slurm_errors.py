"""`multigpu sweep --on slurm` where it cannot submit: one line that says why and what to do,
exit 2, and no sweep folder left behind. No SLURM is started: these are the machines without."""
import subprocess
import sys

from tests.multiproc.conftest import cli_env

COMMAND = ["--on", "slurm", "--devices-per-run", "cpu:1", "--grid", "lr=0.003,0.01", "--out", "sw",
           "--", "multigpu", "train", "--model", "mlp", "--data", "digits"]


def sweep(tmp_path, env):
    return subprocess.run([sys.executable, "-m", "multigpu", "sweep", *COMMAND], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


def test_without_submitit_it_names_the_extra(tmp_path):
    shadow = tmp_path / "shadow" / "submitit"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named submitit')\n")
    env = cli_env()
    env["PYTHONPATH"] = f"{tmp_path / 'shadow'}:{env['PYTHONPATH']}"
    proc = sweep(tmp_path, env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("multigpu: error: multigpu sweep --on slurm needs submitit, "
                                   "which is not installed: pip install 'multigpu[slurm]' (or pip "
                                   "install submitit)")
    assert not (tmp_path / "sw").exists()


def test_without_sbatch_it_says_where_to_submit_from(tmp_path):
    proc = sweep(tmp_path, {**cli_env(), "PATH": str(tmp_path / "empty")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("multigpu: error: --on slurm: sbatch is not on PATH; submit "
                                   "from a machine of the SLURM cluster (a login node), or leave "
                                   "out --on slurm to run the sweep here")
    assert not (tmp_path / "sw").exists()


def test_runs_per_gpu_is_refused_on_slurm(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "multigpu", "sweep", "--runs-per-gpu", "4", *COMMAND],
                          cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("multigpu: error: --runs-per-gpu packs runs onto this machine's "
                                   "GPUs; on SLURM each run is a job of its own: leave it out, or "
                                   "run the sweep here without --on slurm")
    assert not (tmp_path / "sw").exists()
