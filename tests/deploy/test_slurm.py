"""deploy/slurm/ps.sbatch for real on one machine, with fake ``srun``, ``scontrol`` and
``hostname`` on PATH: a real server and two real trainers that train, then the server stops.
And with a fake ``psserver`` too: which processes the script starts, where, with what flags
(several server processes: one step, the rank from SLURM_PROCID)."""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.deploy.commands import DEPLOY, parse
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
    if [[ -n "${FAKE_NODES:-}" ]]; then tr , '\\n' <<< "$FAKE_NODES"; exit 0; fi
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


PSSERVER = '''\
#!{python}
"""Fake psserver: logs its task's rank and argv; `serve` waits for SIGTERM, `train` returns once
every server logged (so the script's SIGTERM never beats a server's handler)."""
import json, os, signal, sys, time

log = os.environ["FAKE_PSSERVER_LOG"]
if sys.argv[1] == "stop":
    sys.exit(1)  # no control plane here: the script signals the servers' step instead
if sys.argv[1] == "serve":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with open(log, "a") as f:
    f.write(json.dumps({{"procid": os.environ.get("SLURM_PROCID"), "argv": sys.argv[1:]}}) + "\\n")
if sys.argv[1] == "serve":
    while True:
        time.sleep(0.1)
deadline = time.time() + 60
while time.time() < deadline:
    with open(log) as f:
        if sum('"serve"' in line for line in f) >= int(os.environ["FAKE_NUM_SERVERS"]):
            break
    time.sleep(0.05)
'''


def _shims(bindir: Path, fake_psserver: bool = False) -> None:
    bindir.mkdir()
    shims = [("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL), ("hostname", HOSTNAME)]
    if fake_psserver:
        shims.append(("psserver", PSSERVER.format(python=sys.executable)))
    for name, text in shims:
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


def _run_fake(tmp_path: Path, nodes: list[str], extra: dict[str, str]):
    """ps.sbatch with fake srun, scontrol and psserver: (exit code, output, srun steps, psserver calls)."""
    bindir = tmp_path / "bin"
    _shims(bindir, fake_psserver=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PSSERVER_", "MASTER_"))}
    env.update({
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SRUN_LOG": str(tmp_path / "srun.log"),
        "FAKE_PSSERVER_LOG": str(tmp_path / "psserver.log"),
        "FAKE_NODES": ",".join(nodes),
        "FAKE_NUM_SERVERS": extra.get("PSSERVER_NUM_SERVERS", "1"),
        "SLURM_JOB_ID": "4343",
        "SLURM_JOB_NODELIST": "node[0-9]",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        **extra,
    })
    r = subprocess.run(["bash", str(DEPLOY / "slurm" / "ps.sbatch")], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    out = r.stdout + r.stderr
    srun_log, psserver_log = tmp_path / "srun.log", tmp_path / "psserver.log"
    steps = [ast.literal_eval(s) for s in srun_log.read_text().splitlines()] if srun_log.exists() else []
    calls = [json.loads(s) for s in psserver_log.read_text().splitlines()] if psserver_log.exists() else []
    return r.returncode, out, steps, calls


def _opt(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} given {argv.count(flag)} times: {argv}"
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("num_servers, addrs", [(1, None), (2, None), (3, None), (2, "10.0.0.1,10.0.0.2")],
                         ids=["one-server", "two-servers", "three-servers", "two-servers-addrs"])
def test_ps_sbatch_starts_num_servers_with_ranks_from_slurm_procid(tmp_path, num_servers, addrs):
    nodes = [f"node{i}" for i in range(num_servers + 2)]
    extra = {"PSSERVER_PORT": "29511"}
    if num_servers != 1:
        extra["PSSERVER_NUM_SERVERS"] = str(num_servers)
    if addrs:
        extra["PSSERVER_SERVER_ADDRS"] = addrs
    code, out, steps, calls = _run_fake(tmp_path, nodes, extra)
    assert code == 0, out
    hosts = addrs.split(",") if addrs else nodes[:num_servers]
    assert f"server on node0 ({hosts[0]}:29511)" in out
    assert f"2 trainer(s) on node{num_servers},node{num_servers + 1}" in out

    # two job steps: every server in one (one task per server node), the trainers in the other
    (serve_step,) = [(o, c) for o, c in steps if "serve" in c]
    (train_step,) = [(o, c) for o, c in steps if "train" in c]
    opts, _ = serve_step
    assert opts["nodes"] == opts["ntasks"] == str(num_servers) and opts["ntasks-per-node"] == "1"
    assert opts["nodelist"] == ",".join(nodes[:num_servers]) and opts["kill-on-bad-exit"] == "1"
    assert train_step[0]["nodelist"] == ",".join(nodes[num_servers:])

    servers = sorted((c for c in calls if c["argv"][0] == "serve"), key=lambda c: int(c["procid"]))
    trainers = [c for c in calls if c["argv"][0] == "train"]
    assert [int(c["procid"]) for c in servers] == list(range(num_servers))
    coordinator = f"{hosts[0]}:29511"
    for c in servers:
        rank, argv = int(c["procid"]), c["argv"]
        assert _opt(argv, "--server-rank") == str(rank)  # the task's SLURM_PROCID
        assert _opt(argv, "--num-servers") == str(num_servers)
        assert _opt(argv, "--coordinator") == coordinator
        for flag in ("--host", "--control-host", "--metrics-host"):  # each server's own node
            assert _opt(argv, flag) == hosts[rank], (flag, argv)
        assert _opt(argv, "--port") == "29511" and "--supervise" in argv and "--resume" in argv
        assert _opt(argv, "--checkpoint-dir") == str(tmp_path / "checkpoints")
        parse(argv)  # the real CLI takes it
    tokens = {_opt(c["argv"], "--join-token-file") for c in calls}
    assert len(tokens) == 1, "one join token for every server and trainer"
    assert len(trainers) == 2
    for c in trainers:
        assert _opt(c["argv"], "--server") == coordinator and _opt(c["argv"], "--num-trainers") == "2"
        parse(c["argv"])


@pytest.mark.parametrize("nodes, extra, message", [
    (2, {"PSSERVER_NUM_SERVERS": "2"}, "needs at least 3 nodes (2 server(s) + trainers), got 2"),
    (3, {"PSSERVER_NUM_SERVERS": "0"}, "needs at least"),
    (4, {"PSSERVER_NUM_SERVERS": "2", "PSSERVER_SERVER_ADDRS": "10.0.0.1"}, "names 1 address(es) for 2 server(s)"),
], ids=["too-few-nodes", "zero-servers", "addrs-mismatch"])
def test_ps_sbatch_refuses_a_bad_layout(tmp_path, nodes, extra, message):
    code, out, steps, calls = _run_fake(tmp_path, [f"node{i}" for i in range(nodes)], extra)
    assert code == 2 and message in out, out
    assert not steps and not calls
