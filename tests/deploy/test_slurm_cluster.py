"""deploy/slurm/*.sbatch submitted with ``sbatch`` to a real Slurm cluster on this machine
(``tests/deploy/slurm_cluster.py``: munged, slurmctld, one slurmd per node), as a user would:
the jobs train mnist_cnn for a few steps and must end COMPLETED with every trainer's accuracy
in their output."""

from __future__ import annotations

import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.deploy.commands import DEPLOY
from tests.deploy.slurm_cluster import SlurmCluster, missing
from tests.procs import MNIST_ARGS, env, free_port

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(240)]

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
        f"job {job} ({script}) ended {state} {code}:\n{textwrap.indent(_digest(out), '  ')}\n{slurm.daemon_logs()}")
    return str(job), out


def _output(workdir: Path, job: int | str) -> str:
    path = workdir / f"job-{job}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output file)"


ROUTINE = re.compile(r"psserver\.utils\.progress: |memory_state: state in memory: ")


def _digest(out: str, n: int = 2500) -> str:
    """A failed job's output for the assertion: without its progress lines, whole when short,
    else its first and last ``n`` characters (a task that failed early shows at the start)."""
    text = "\n".join(line for line in out.splitlines() if not ROUTINE.search(line))
    return text if len(text) <= 2 * n else f"{text[:n]}\n[...]\n{text[-n:]}"


def _accuracies(out: str) -> dict[int, float]:
    return {int(r): float(a) for r, a in re.findall(r"^rank (\d+) accuracy ([0-9.]+)$", out, re.M)}


def test_ps_sbatch_trains_with_two_servers_on_four_real_slurm_nodes(slurm, tmp_path):
    # both servers bind the same port, each on its own node's address
    _, out = _submit_and_wait(slurm, "ps.sbatch", tmp_path, 4, _job_env(PSSERVER_NUM_SERVERS="2"))
    tail = _digest(out)
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
                       PSSERVER_TRAIN_ARGS=" ".join([*MNIST_ARGS, "--control-port", str(free_port())]),
                       TMPDIR=str(tmp_path))  # each node's torchrun makes its log directory there
    _, out = _submit_and_wait(slurm, "ddp.sbatch", tmp_path, 2, job_env, "--gpus-per-node=0")
    tail = _digest(out)
    assert re.search(r"psserver ddp: 2 node\(s\) x 1 process\(es\), rendezvous n\d \(127\.0\.0\.\d+:\d+\)", out), tail
    assert "rank 1/2 joined (gloo, cpu)" in out or "DDP: 2 ranks" in out, tail
    assert set(_accuracies(out)) == {0}, tail  # rank 0 evaluates the one model


def _wait_for_output(slurm: SlurmCluster, workdir: Path, job: int, pattern: str, count: int, timeout: float) -> str:
    """The job's output once ``pattern`` occurs ``count`` times in it; fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = _output(workdir, job)
        if len(re.findall(pattern, out, re.M)) >= count:
            return out
        state, code = slurm.state(job)
        if state not in ("PENDING", "CONFIGURING", "RUNNING"):
            raise AssertionError(f"job {job} ended {state} {code} before /{pattern}/:\n{_digest(out)}")
        time.sleep(0.5)
    slurm.run(["scancel", str(job)], check=False)
    raise AssertionError(f"job {job}: no /{pattern}/ x{count} within {timeout}s:\n{_digest(_output(workdir, job))}\n"
                         f"{slurm.daemon_logs()}")


def test_scancel_of_a_ps_job_checkpoints_and_a_resubmitted_job_resumes_from_it(slurm, tmp_path):
    # a long run (2000 steps), cancelled once both trainers train: Slurm sends SIGTERM to every task
    job = slurm.sbatch(DEPLOY / "slurm" / "ps.sbatch", "--nodes=3", f"--output={tmp_path}/job-%j.out",
                       env=_job_env(PSSERVER_MAX_STEPS="2000", PSSERVER_EPOCHS="20"), cwd=tmp_path)
    _wait_for_output(slurm, tmp_path, job, r"rank \d/2: \d+ training samples", 2, JOB_TIMEOUT)
    time.sleep(3)  # some steps
    slurm.run(["scancel", str(job)])
    state, _ = slurm.wait(job, JOB_TIMEOUT)
    out = _output(tmp_path, job)
    tail = textwrap.indent(_digest(out), "  ")
    assert state == "CANCELLED", f"{state}:\n{tail}"
    # the trainers left, the server wrote its final checkpoint and stopped
    assert len(re.findall(r"trainer trainer_\d+_\d+ \(rank \d\) left after \d+ steps", out)) == 2, tail
    m = re.search(r"checkpoint step (\d+) written to (\S+)", out)
    assert m and int(m.group(1)) > 0, tail
    step = int(m.group(1))
    assert f"psserver stopped at global step {step}" in out, tail
    assert Path(m.group(2)).exists() and not (tmp_path / f".psserver-{job}").exists()

    # the same job again, in the same directory: it resumes from that checkpoint and completes
    job2, out2 = _submit_and_wait(slurm, "ps.sbatch", tmp_path, 3, _job_env(PSSERVER_MAX_STEPS="10"))
    tail2 = _digest(out2)
    # the server on the first node, at its NodeAddr (the node names resolve nowhere here)
    assert re.search(r"server on n\d \(127\.0\.0\.\d+:\d+\), 2 trainer\(s\) on n\d,n\d", out2), tail2
    assert "CANCELLED" not in out2, tail2  # stopped through the control plane (psserver stop), no signal
    assert not (tmp_path / f".psserver-{job2}").exists(), "the job's join token was left behind"
    assert f"resumed from {m.group(2)}: global step {step}," in out2, tail2
    assert f"resumed at step {step}" in out2 and set(_accuracies(out2)) == {0, 1}, tail2
    assert re.search(rf"psserver stopped at global step {step + 20}\b", out2), tail2
    # its final checkpoint, written once it was stopped through the control plane
    assert re.search(rf"checkpoint step {step + 20} written to", out2), tail2
    assert "final checkpoint failed" not in out2, tail2


def test_scancel_batch_sigterm_of_a_two_server_job_writes_both_parts_of_the_final_checkpoint(slurm, tmp_path):
    # SIGTERM to the batch script only: it stops the trainers, then the servers through server 0
    job = slurm.sbatch(DEPLOY / "slurm" / "ps.sbatch", "--nodes=4", f"--output={tmp_path}/job-%j.out",
                       env=_job_env(PSSERVER_NUM_SERVERS="2", PSSERVER_MAX_STEPS="2000", PSSERVER_EPOCHS="20"),
                       cwd=tmp_path)
    _wait_for_output(slurm, tmp_path, job, r"rank \d/2: \d+ training samples", 2, JOB_TIMEOUT)
    time.sleep(3)
    slurm.run(["scancel", "--batch", "--signal=TERM", str(job)])
    slurm.wait(job, JOB_TIMEOUT)
    out = _output(tmp_path, job)
    tail = textwrap.indent(_digest(out), "  ")
    assert len(re.findall(r"trainer trainer_\d+_\d+ \(rank \d\) left after \d+ steps", out)) == 2, tail
    steps = {int(n) for n in re.findall(r"checkpoint step (\d+) written to \S+/server-\d/", out)}
    assert len(steps) == 1 and steps.pop() > 0, tail
    for i in (0, 1):
        assert list((tmp_path / "checkpoints" / f"server-{i}").glob("*.pt")), f"server {i}: no checkpoint\n{tail}"
    assert "final checkpoint failed" not in out and not (tmp_path / f".psserver-{job}").exists(), tail
