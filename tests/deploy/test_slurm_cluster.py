"""deploy/slurm/*.sbatch submitted with ``sbatch`` to a real Slurm cluster on this machine
(``tests/deploy/slurm_cluster.py``: munged, slurmctld, one slurmd per node), as a user would:
the jobs train mnist_cnn for a few steps and must end COMPLETED with every trainer's accuracy
in their output."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from tests.deploy.commands import DEPLOY
from tests.deploy.slurm_cluster import SlurmCluster, missing
from tests.procs import MNIST_ARGS, env, free_port

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

JOB_TIMEOUT = 90  # seconds a small job may take, queueing included


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """One cluster of 4 nodes for every test here, stopped (daemons, jobs) after the last."""
    why = missing()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=4)
    try:
        cluster.start()
    except Exception as e:  # noqa: BLE001 - whatever stops it, the tests cannot run here
        cluster.stop()
        pytest.skip(f"the Slurm cluster did not start: {str(e)[-1500:]}")
    yield cluster
    cluster.stop()


def _job_env(**extra: str) -> dict[str, str]:
    """The submitting shell's environment: this checkout first on PYTHONPATH (sbatch exports it to
    every task), small settings, fresh ports (the nodes share this machine's ports per address)."""
    return env(
        PATH=f"{Path(sys.executable).parent}:{env()['PATH']}",
        PSSERVER_MODEL="mnist_cnn", PSSERVER_EPOCHS="1", PSSERVER_MAX_STEPS="20", PSSERVER_BATCH_SIZE="32",
        PSSERVER_TRAIN_ARGS=" ".join(MNIST_ARGS), PSSERVER_CONNECT_TIMEOUT="60", OMP_NUM_THREADS="1",
        PSSERVER_PORT=str(free_port()), PSSERVER_CONTROL_PORT=str(free_port()),
        PSSERVER_METRICS_PORT=str(free_port()), **extra,
    )


def _submit_and_wait(slurm: SlurmCluster, script: str, workdir: Path, nodes: int, job_env: dict[str, str],
                     *options: str) -> tuple[str, str]:
    """Submits, waits for the end; fails with the job's output and the daemons' logs unless it
    COMPLETED with exit 0. Returns (job id, output)."""
    workdir.mkdir(exist_ok=True)
    job = slurm.sbatch(DEPLOY / "slurm" / script, f"--nodes={nodes}", f"--output={workdir}/job-%j.out", *options,
                       env=job_env, cwd=workdir)
    state, code = slurm.wait(job, JOB_TIMEOUT)
    out = _output(workdir, job)
    assert (state, code) == ("COMPLETED", "0:0"), (
        f"job {job} ({script}) ended {state} {code}:\n{textwrap.indent(out[-3000:], '  ')}\n{slurm.daemon_logs()}")
    return str(job), out


def _output(workdir: Path, job: int | str) -> str:
    path = workdir / f"job-{job}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output file)"


def _accuracies(out: str) -> dict[int, float]:
    return {int(r): float(a) for r, a in re.findall(r"^rank (\d+) accuracy ([0-9.]+)$", out, re.M)}


def test_ps_sbatch_trains_with_one_server_and_two_trainers_on_real_slurm(slurm, tmp_path):
    job, out = _submit_and_wait(slurm, "ps.sbatch", tmp_path, 3, _job_env())
    tail = out[-3000:]
    # the server on the first node, at its NodeAddr (the node names resolve nowhere here)
    assert re.search(r"server on n\d \(127\.0\.0\.\d+:\d+\), 2 trainer\(s\) on n\d,n\d", out), tail
    assert set(_accuracies(out)) == {0, 1}, tail
    assert re.search(r"psserver stopped at global step [1-9]", out), tail
    assert list((tmp_path / "checkpoints").glob("*.pt")), "no final checkpoint"
    assert not (tmp_path / f".psserver-{job}").exists(), "the job's join token was left behind"
