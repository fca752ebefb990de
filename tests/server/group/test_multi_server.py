"""Several server processes hold one model (``--num-servers``), through the real CLI and RPC:
the same weights as one server, accuracy with two trainers, the status of every server, a
server killed and restarted, and the errors a misconfigured server gets."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import torch

from psserver.checkpoint import checkpoint_path, list_checkpoints, read_checkpoint, step_of
from psserver.common.partition import PartitionPlan
from psserver.control.client import ControlClient
from psserver.control.v1.control_pb2 import ServerState
from tests.procs import cli, free_port, run, slow_steps, start_servers, wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS, BATCH, LR = 20, 256, 0.01
LISTENING = re.compile(r"control plane listening on (\S+):(\d+)")


def gathered(ckpt: Path, n: int) -> list[torch.Tensor]:
    """The whole model's parameters from each server's newest checkpoint file, in model order."""
    newest = [list_checkpoints(ckpt / f"server-{i}")[0] for i in range(n)]
    steps = {step_of(path) for path in newest}
    assert len(steps) == 1, f"servers' newest checkpoints are of different steps: {steps}"
    states = [read_checkpoint(path) for path in newest]
    plan = PartitionPlan.from_dict(states[0]["partition"]["plan"])
    buffers = [torch.cat([v.reshape(-1) for v in s["shards"][0]["module"].values()]) for s in states]
    like = [torch.empty(n) for n in plan.sizes]
    return plan.gather(buffers, like)


@pytest.mark.timeout(240)
def test_two_servers_give_the_weights_of_one_in_sync(procs, port, tmp_path):
    """One trainer, ``--update sync --sync-trainers 1``, 20 Adam steps of ``mlp``: two server
    processes end with the parameters one server ends with (to 1e-6)."""
    common = ["--model", "mlp", "--update", "sync", "--sync-trainers", "1"]
    train = ["--num-trainers", "1", "--epochs", "2", "--max-steps", str(STEPS), "--batch-size", str(BATCH),
             "--optimizer", "adam", "--lr", str(LR)]
    one = procs.server(port, *common, "--checkpoint-dir", str(tmp_path / "one"))
    t = procs.trainer(port, 0, *train)
    assert t.wait(120) == 0, t.tail()
    assert procs.stop(one) == 0, one.tail()
    single = read_checkpoint(list_checkpoints(tmp_path / "one")[0])
    expected = list(single["shards"][0]["module"].values())

    port2 = free_port()
    servers = start_servers(procs, port2, 2, *common, ckpt=tmp_path / "two")
    t2 = procs.trainer(port2, 0, *train)
    assert t2.wait(120) == 0, t2.tail()
    assert procs.stop(servers[0]) == 0, servers[0].tail()  # the final checkpoint, every partition of it
    assert servers[1].wait(30) == 0, servers[1].tail()  # server 0 stopped it
    got = gathered(tmp_path / "two", 2)
    for i in range(2):
        state = read_checkpoint(list_checkpoints(tmp_path / "two" / f"server-{i}")[0])
        assert state["global_step"] == STEPS
        assert state["partition"]["server_rank"] == i and state["partition"]["num_servers"] == 2
    diffs = [float((g.reshape(-1) - e.reshape(-1)).abs().max()) for g, e in zip(got, expected, strict=True)]
    assert max(diffs) <= 1e-6, diffs
    assert float((expected[0] - single["shards"][0]["module"]["1.weight"]).abs().max()) == 0


@pytest.mark.timeout(240)
def test_sync_rounds_are_the_same_on_every_server(procs, port, tmp_path):
    """Two trainers, ``--update sync --sync-trainers 2``, three servers (the second trainer
    joins while the first trains): every server applies the rounds server 0 decides, so all
    end at the same global step with the same optimizer step count."""
    servers = start_servers(procs, port, 3, "--model", "mlp", "--update", "sync", "--sync-trainers", "2",
                            ckpt=tmp_path)
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--max-steps", "40", "--batch-size", "32")
                for r in range(2)]
    for t in trainers:
        assert t.wait(120) == 0, t.tail()
    assert procs.stop(servers[0]) == 0, servers[0].tail()
    for s in servers[1:]:
        assert s.wait(30) == 0, s.tail()
    states = [read_checkpoint(list_checkpoints(tmp_path / f"server-{i}")[0]) for i in range(3)]
    assert len({s["global_step"] for s in states}) == 1, [s["global_step"] for s in states]
    assert len({s["samples_seen"] for s in states}) == 1
    optimizer_steps = {int(v["step"]) for s in states for v in s["shards"][0]["optimizer"]["state"].values()}
    assert optimizer_steps == {states[0]["global_step"]}
    assert 40 <= states[0]["global_step"] <= 80


@pytest.mark.timeout(300)
def test_two_servers_two_trainers_show_in_status_and_apply_every_step(procs, port):
    """2 server processes + 2 trainers, ``mnist_cnn`` (on the synthetic data made to its input):
    status lists both servers, each holding about half the bytes, and each applied one update per
    trainer step. (That two servers train as one does: test_two_servers_give_the_weights_of_one_in_sync.)"""
    servers = start_servers(procs, port, 2, "--model", "mnist_cnn", control=True)
    address = "{}:{}".format(*servers[0].wait_for(LISTENING.pattern, timeout=30).groups())
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--max-steps", "20") for r in range(2)]
    for t in trainers:
        assert t.wait(180) == 0, t.tail()
    client = ControlClient(address, timeout=10)
    try:
        status = client.get_status()
    finally:
        client.close()
    assert [s.rank for s in status.servers] == [0, 1]
    assert [s.name for s in status.servers] == ["psserver", "psserver_1"]
    total = sum(s.bytes for s in status.servers)
    assert total == status.num_params * 4
    for s in status.servers:
        assert abs(s.bytes / total - 0.5) <= 0.05, [(x.rank, x.bytes) for x in status.servers]
        assert s.updates_applied > 0
    # Both trainers' steps reached both servers: each applied one update per trainer step.
    steps = sum(int(re.search(r"rank \d+: (\d+) steps", t.output()).group(1)) for t in trainers)
    assert [s.updates_applied for s in status.servers] == [steps, steps]
    done = cli(["--log-level", "ERROR", "status", "--address", address])
    assert done.returncode == 0, done.stderr
    assert "psserver_1" in done.stdout


@pytest.mark.timeout(300)
def test_a_killed_server_comes_back_and_every_server_returns_to_one_checkpoint(procs, port, tmp_path):
    """SIGKILL server 1 mid-training: a trainer without ``--reconnect`` exits 3 naming it, one
    with it waits; server 1 restarted with ``--resume``: every server loads the same complete
    checkpoint and the trainer finishes."""
    ckpt = tmp_path / "ckpt"
    common = ["--model", "mlp", "--checkpoint-every", "20", "--trainer-timeout", "2"]
    servers = start_servers(procs, port, 2, *common, ckpt=ckpt)
    slow = slow_steps(0.02)
    keeps = procs.trainer(port, 0, "--num-trainers", "2", "--epochs", "3", "--reconnect", env=slow)
    quits = procs.trainer(port, 1, "--num-trainers", "2", "--epochs", "3", env=slow)
    servers[0].wait_for(r"checkpoint step (\d+) written", timeout=90)
    time.sleep(1.0)
    servers[1].signal(signal.SIGKILL)
    servers[1].wait(10)
    servers[0].wait_for(r"server 1 \(psserver_1 on \S+\) lost", timeout=30)
    assert quits.wait(60) == 3, quits.tail()
    assert "server 1 (psserver_1)" in quits.output(), quits.tail()

    back = procs.start(["serve", "--num-servers", "2", "--server-rank", "1", "--coordinator", f"127.0.0.1:{port}",
                        "--port", str(free_port()), "--checkpoint-dir", str(ckpt), "--resume", *common], "server1-back")
    step = int(servers[0].wait_for(r"every server goes back to checkpoint step (\d+)", timeout=60).group(1))
    back.wait_for(r"resumed from \S+: global step", timeout=30)
    assert f"loads checkpoint step {step}" in servers[0].output()
    assert re.search(rf"resumed from \S+server-1/ckpt-0*{step}\.pt: global step", back.output()), back.tail()
    assert (ckpt / "server-0" / checkpoint_path(Path(), step).name).is_file()
    assert (ckpt / "server-1" / checkpoint_path(Path(), step).name).is_file()
    assert keeps.wait(180) == 0, keeps.tail()
    assert "reconnected as trainer_0_" in keeps.output()
    assert procs.stop(servers[0]) == 0, servers[0].tail()
    assert back.wait(30) == 0, back.tail()


@pytest.mark.timeout(300)
def test_a_server_killed_mid_step_continues_from_memory_and_every_step_lands_once(procs, port, tmp_path):
    """Two server processes with their state in memory, two ``--reconnect`` trainers stepping:
    server 1 SIGKILLed mid-training and started again with the job's key continues from its own
    state (no server goes back), the trainers hand in again the steps that failed on it, and at
    the end each server has applied every trainer step exactly once."""
    common = ["--model", "mlp", "--trainer-timeout", "2", "--state-dir", str(tmp_path / "state"),
              "--state-key", "job"]
    servers = start_servers(procs, port, 2, *common, control=True)
    address = "{}:{}".format(*servers[0].wait_for(LISTENING.pattern, timeout=30).groups())
    slow = slow_steps(0.02)
    train = ["--num-trainers", "2", "--epochs", "5", "--max-steps", "150", "--batch-size", "32", "--reconnect"]
    trainers = [procs.trainer(port, r, *train, env=slow) for r in range(2)]
    client = ControlClient(address, timeout=10)
    try:
        wait_until(lambda: client.get_status().global_step >= 60, 90, "global step 60", servers, every=0.1)
        servers[1].signal(signal.SIGKILL)
        servers[1].wait(10)
        servers[0].wait_for(r"server 1 \(psserver_1 on \S+\) lost", timeout=30)
        procs.start(["serve", "--num-servers", "2", "--server-rank", "1", "--coordinator", f"127.0.0.1:{port}",
                     "--port", str(free_port()), *common], "server1-back")
        servers[0].wait_for(r"server 1 comes back with its state in memory \(its global step \d+\): no server "
                            r"goes back", timeout=90)
        for t in trainers:
            assert t.wait(180) == 0, t.tail()
            assert "reconnected as trainer_" in t.output(), t.tail()
        steps = sum(int(re.search(r"rank \d+: (\d+) steps", t.output()).group(1)) for t in trainers)
        assert steps == 300
        # server 1's count reaches server 0 with its next watch
        wait_until(lambda: [s.updates_applied for s in client.get_status().servers] == [steps, steps], 15,
                   f"both servers to count {steps} updates")
    finally:
        client.close()
    assert procs.stop(servers[0]) == 0, servers[0].tail()
    assert "every server goes back to checkpoint" not in servers[0].output()


@pytest.mark.timeout(180)
def test_a_job_wide_sigterm_ends_with_every_part_of_the_final_checkpoint(procs, port, tmp_path):
    """SIGTERM to every server process at about the same time (``scancel``, a deleted pod set),
    server 1's 0.3 s first: it asks server 0, which waits for its own stop and has it wait for the final
    checkpoint, whose every part is written; both exit 0."""
    servers = start_servers(procs, port, 2, "--model", "mlp", ckpt=tmp_path)
    t = procs.trainer(port, 0, "--max-steps", "20")
    assert t.wait(120) == 0, t.tail()
    servers[1].signal(signal.SIGTERM)
    time.sleep(0.3)  # the signals of one job reach its processes on several nodes about together
    servers[0].signal(signal.SIGTERM)
    assert servers[0].wait(60) == 0, servers[0].tail()
    assert servers[1].wait(60) == 0, servers[1].tail()
    assert "waiting for its final checkpoint" in servers[1].output(), servers[1].tail()
    newest = [list_checkpoints(tmp_path / f"server-{i}")[0] for i in range(2)]
    assert [step_of(path) for path in newest] == [20, 20], newest
    assert "lost" not in servers[0].output(), servers[0].tail()


@pytest.mark.timeout(180)
def test_health_is_serving_only_while_every_server_process_is_there(procs, port):
    """A readiness probe admits trainers only when they can train: server 0's gRPC health is
    NOT_SERVING until server 1 registers, SERVING then, NOT_SERVING while server 1 is lost, and
    SERVING again once it is back."""
    def health_becomes(client: ControlClient, want: str, timeout: float = 30.0) -> None:
        wait_until(lambda: client.health(timeout=2.0) == want, timeout, f"health {want}", every=0.1)

    common = ["--model", "mlp", "--num-servers", "2"]
    s0 = procs.server(port, *common, "--server-rank", "0", control_port=0, wait=False)
    s0.wait_for(r"waiting for server process\(es\) 1 of 2 to register", timeout=90)
    address = "{}:{}".format(*s0.wait_for(LISTENING.pattern, timeout=30).groups())
    s0.wait_for(r"serving \S+ on", timeout=30)
    client = ControlClient(address, timeout=10)
    try:
        assert client.health() == "NOT_SERVING"
        assert ServerState.Name(client.get_status().state) == "SERVER_STATE_STARTING"
        one = ["serve", *common, "--server-rank", "1", "--coordinator", f"127.0.0.1:{port}"]
        s1 = procs.start([*one, "--port", str(free_port())], "server1")
        health_becomes(client, "SERVING", 90)
        s1.signal(signal.SIGKILL)
        s1.wait(10)
        health_becomes(client, "NOT_SERVING")
        assert ServerState.Name(client.get_status().state) == "SERVER_STATE_WAITING"
        procs.start([*one, "--port", str(free_port())], "server1-back")
        health_becomes(client, "SERVING", 90)
    finally:
        client.close()
    assert procs.stop(s0) == 0, s0.tail()


@pytest.mark.timeout(120)
def test_misconfigured_servers_get_one_line(procs, port):
    r = cli(["serve", "--num-servers", "2", "--server-rank", "1"])
    assert r.returncode == 2 and "needs --coordinator" in r.stderr and "Traceback" not in r.stderr
    r = cli(["serve", "--num-servers", "2", "--server-rank", "2", "--coordinator", "127.0.0.1:1"])
    assert r.returncode == 2 and "--server-rank 2 must be in 0..1" in r.stderr
    s0 = procs.server(port, "--model", "mlp", "--num-servers", "2", "--server-rank", "0", wait=False)
    s0.wait_for(r"waiting for server process\(es\) 1 of 2", timeout=60)
    r = run(["serve", "--model", "mnist_cnn", "--num-servers", "2", "--server-rank", "1", "--coordinator",
             f"127.0.0.1:{port}", "--port", str(free_port())], timeout=60)
    assert r.returncode == 2, r.stderr
    assert "server 0 refused this server: model mnist_cnn" in r.stderr and "Traceback" not in r.stderr
    # A trainer meanwhile waits for the missing server, then says so.
    t = run(["train", "--server", f"127.0.0.1:{port}", "--rank", "0", "--connect-timeout", "3"], timeout=60)
    assert t.returncode == 2 and "did not finish starting" in t.stderr, t.stderr
