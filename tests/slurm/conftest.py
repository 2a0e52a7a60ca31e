"""A real SLURM on localhost for the tests that need one (tests/slurm/localslurm.py: munged,
slurmctld and one slurmd under a temporary folder), started once per session by `slurm_cluster`
and stopped after; `slurm_two_nodes` is another with two slurmd, two nodes on this machine. Client
commands find it through SLURM_CONF in `cluster.env`, which tests pass to the processes they start
(the environment of pytest itself is restored after each test).

A daemon that does not start fails the test with its log: CI installs SLURM, so a skip there
would hide a broken tier.
"""
import pytest

from tests.slurm.localslurm import SlurmStartError, local_slurm


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    try:
        with local_slurm(tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster
    except SlurmStartError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def slurm_two_nodes(tmp_path_factory):
    try:
        with local_slurm(tmp_path_factory.mktemp("slurm2"), nodes=2) as cluster:
            yield cluster
    except SlurmStartError as e:
        pytest.fail(str(e))
