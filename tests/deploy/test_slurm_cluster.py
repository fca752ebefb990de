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
    settings = {
        "PATH": f"{Path(sys.executable).parent}:{env()['PATH']}",
        "PSSERVER_MODEL": "mnist_cnn", "PSSERVER_EPOCHS": "1", "PSSERVER_MAX_STEPS": "20",
        "PSSERVER_BATCH_SIZE": "32", "PSSERVER_TRAIN_ARGS": " ".join(MNIST_ARGS), "PSSERVER_CONNECT_TIMEOUT": "60",
        "OMP_NUM_THREADS": "1", "PSSERVER_PORT": str(free_port()), "PSSERVER_CONTROL_PORT": str(free_port()),
        "PSSERVER_METRICS_PORT": str(free_port()),
    }
    return env(**{**settings, **extra})


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
    assert "CANCELLED" not in out, tail  # stopped through the control plane (psserver stop), no signal
    assert list((tmp_path / "checkpoints").glob("*.pt")), "no final checkpoint"
    assert not (tmp_path / f".psserver-{job}").exists(), "the job's join token was left behind"


def test_ps_sbatch_trains_with_two_servers_on_four_real_slurm_nodes(slurm, tmp_path):
    # both servers bind the same port, each on its own node's address
    _, out = _submit_and_wait(slurm, "ps.sbatch", tmp_path, 4, _job_env(PSSERVER_NUM_SERVERS="2"))
    tail = out[-3000:]
    assert re.search(r"server on n\d \(127\.0\.0\.\d+:\d+\) \+ 1 more server\(s\) on n\d, 2 trainer\(s\)", out), tail
    assert set(_accuracies(out)) == {0, 1}, tail
    assert "all 2 server processes are serving" in out, tail
    assert "CANCELLED" not in out and "final checkpoint failed" not in out, tail
    for i in (0, 1):  # each server wrote its partition of the final checkpoint
        assert list((tmp_path / "checkpoints" / f"server-{i}").glob("*.pt")), f"server {i}: no checkpoint\n{tail}"


def test_ddp_sbatch_trains_with_a_torchrun_rendezvous_across_real_slurm_nodes(slurm, tmp_path):
    # no GPUs here: --gpus-per-node=0 on the command line overrides the script's, one process per
    # node (gloo on the CPU), the rendezvous on the first node's NodeAddr
    job_env = _job_env(PSSERVER_NPROC_PER_NODE="1", PSSERVER_RDZV_PORT=str(free_port()),
                       PSSERVER_TRAIN_ARGS=" ".join([*MNIST_ARGS, "--control-port", str(free_port())]))
    _, out = _submit_and_wait(slurm, "ddp.sbatch", tmp_path, 2, job_env, "--gpus-per-node=0")
    tail = out[-3000:]
    assert re.search(r"psserver ddp: 2 node\(s\) x 1 process\(es\), rendezvous n\d \(127\.0\.0\.\d+:\d+\)", out), tail
    assert "rank 1/2 joined (gloo, cpu)" in out or "DDP: 2 ranks" in out, tail
    assert set(_accuracies(out)) == {0}, tail  # rank 0 evaluates the one model
