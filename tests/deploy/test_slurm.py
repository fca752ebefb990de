"""deploy/slurm/ps.sbatch for real on one machine, with fake ``srun``, ``scontrol`` and
``hostname`` on PATH: a real server and two real trainers that train, then the server stops."""

from __future__ import annotations

import ast
import os
import re
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from tests.deploy.commands import DEPLOY
from tests.procs import free_port

SRUN = '''\
#!{python}
"""Fake srun: runs the step's tasks here, with SLURM_PROCID/NODEID/LOCALID, forwarding signals."""
import os, signal, subprocess, sys, time

VALUE_OPTS = {{"-N": "nodes", "-n": "ntasks", "-w": "nodelist", "-c": "cpus-per-task",
               "--nodes": "nodes", "--ntasks": "ntasks", "--nodelist": "nodelist",
               "--ntasks-per-node": "ntasks-per-node", "--cpus-per-task": "cpus-per-task"}}
args, opts, i = sys.argv[1:], {{}}, 0
while i < len(args) and args[i].startswith("-"):
    a = args[i]
    if a.startswith("--") and "=" in a:
        k, v = a[2:].split("=", 1)
        opts[k] = v
    elif a in VALUE_OPTS:
        opts[VALUE_OPTS[a]] = args[i + 1]
        i += 1
    else:
        opts[a.lstrip("-")] = "1"
    i += 1
cmd = args[i:]
nodes = int(opts.get("nodes", 1))
ntasks = int(opts.get("ntasks", nodes * int(opts.get("ntasks-per-node", 1))))
per_node = max(1, ntasks // nodes)
with open(os.environ["FAKE_SRUN_LOG"], "a") as log:
    log.write(repr((opts, cmd)) + "\\n")
procs = []
for rank in range(ntasks):
    env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_NODEID=str(rank // per_node),
               SLURM_LOCALID=str(rank % per_node), SLURM_NTASKS=str(ntasks), SLURM_NNODES=str(nodes),
               SLURM_STEP_NUM_TASKS=str(ntasks))
    procs.append(subprocess.Popen(cmd, env=env))

def forward(signum, frame):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)

signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
while any(p.poll() is None for p in procs):
    if opts.get("kill-on-bad-exit") == "1" and any(p.returncode not in (None, 0) for p in procs):
        forward(signal.SIGKILL, None)
    time.sleep(0.2)
codes = [p.returncode for p in procs]
sys.exit(next((c if c > 0 else 128 - c for c in codes if c != 0), 0))
'''

SCONTROL = '''\
#!/bin/bash
# Fake scontrol: `show hostnames LIST` prints one name per node of the fake allocation.
if [[ "$1" == show && "$2" == hostnames ]]; then
    for ((i = 0; i < ${FAKE_NNODES:-3}; i++)); do echo localhost; done
    exit 0
fi
echo "fake scontrol: unsupported: $*" >&2
exit 1
'''

HOSTNAME = '''\
#!/bin/bash
echo localhost
'''


def _shims(bindir: Path) -> None:
    bindir.mkdir()
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL),
                       ("hostname", HOSTNAME)):
        path = bindir / name
        path.write_text(text)
        path.chmod(0o755)


def _port_closed(port: int) -> bool:
    """Nothing accepts connections on ``port`` any more (a connect, not a bind)."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ps_sbatch_runs_server_and_two_trainers(tmp_path, procs):
    bindir = tmp_path / "bin"
    _shims(bindir)
    port, control_port, metrics_port = free_port(), free_port(), free_port()
    # tests.procs.env() already leaves out SLURM_PROCID, SLURM_NTASKS and PSSERVER_AUTH_TOKEN.
    env = {
        "PATH": f"{bindir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SRUN_LOG": str(tmp_path / "srun.log"),
        "FAKE_NNODES": "3",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[0-2]",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "PSSERVER_PORT": str(port),
        "PSSERVER_CONTROL_PORT": str(control_port),
        "PSSERVER_METRICS_PORT": str(metrics_port),
        "PSSERVER_MODEL": "mlp",
        "PSSERVER_EPOCHS": "1",
        "PSSERVER_MAX_STEPS": "20",
        "PSSERVER_CONNECT_TIMEOUT": "120",
        "OMP_NUM_THREADS": "1",
    }
    # Its whole session (the fake srun, the server, the trainers) is killed after the test.
    job = procs.start([str(DEPLOY / "slurm" / "ps.sbatch")], "ps.sbatch", prefix=["bash"], env=env, cwd=tmp_path,
                      log=tmp_path / "ps.sbatch.out")
    returncode = job.wait(240)
    out = job.output()
    tail = textwrap.indent(out[-6000:], "  ")
    assert returncode == 0, f"ps.sbatch exited with {returncode}:\n{tail}"
    for rank in (0, 1):
        assert re.search(rf"^rank {rank} accuracy [0-9.]+$", out, re.M), f"no accuracy from rank {rank}:\n{tail}"
    assert "server on localhost (localhost:" in out and "2 trainer(s)" in out
    # The server drained on SIGTERM, wrote a final checkpoint and is gone.
    assert re.search(r"psserver stopped at global step [1-9]", out), tail
    assert list((tmp_path / "checkpoints").glob("*.pt")), "no final checkpoint"
    assert _port_closed(port) and _port_closed(control_port) and _port_closed(metrics_port)
    steps = (tmp_path / "srun.log").read_text().splitlines()
    assert len(steps) == 2  # two job steps, started concurrently (either may log first)
    (serve,) = [s for s in steps if "'serve'" in s]
    (train,) = [s for s in steps if "'train'" in s]
    assert "'nodes': '1'" in serve and "'ntasks': '1'" in serve
    assert "'nodes': '2'" in train and "'ntasks': '2'" in train
    # one join token for the server and the trainers, made for the job and removed after it
    (_, serve_cmd), (_, train_cmd) = ast.literal_eval(serve), ast.literal_eval(train)
    token = serve_cmd[serve_cmd.index("--join-token-file") + 1]
    assert train_cmd[train_cmd.index("--join-token-file") + 1] == token
    assert Path(token).parent.name == ".psserver-4242" and Path(token).parent.parent == tmp_path
    assert not Path(token).parent.exists(), "the job's join token was left behind"
    assert "--supervise" in serve_cmd and "--reconnect" in train_cmd
