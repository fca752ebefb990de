"""Trainers that leave and come back, with real processes and signals: paused past the server's
``--trainer-timeout`` and continued (SIGSTOP, SIGCONT), preempted (SIGTERM, SIGINT), crashed and
restarted at once with the same rank (SIGKILL), and a server killed and restarted under them."""

from __future__ import annotations

import datetime
import re
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

from psserver.common.rendezvous import request_admission
from tests.procs import Proc, ProcessGroup, free_port, slow_protocol_setup, slow_steps

pytestmark = pytest.mark.multiprocess

DELAY = slow_steps(0.05)  # a trainer slow enough to be caught mid-run
SHARDS = 8  # the synthetic 4,096 samples over 8 ranks, batches of 16: 32 steps an epoch
RUN = ["--num-trainers", str(SHARDS), "--batch-size", "16", "--epochs", "2"]
JOINED = r"joined psserver \S+ as (trainer_\d+_\d+)"


def stamp(proc: Proc, pattern: str) -> datetime.datetime:
    """The time of the log line of ``proc`` that matches ``pattern`` (its first)."""
    m = re.search(rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) .*{pattern}", proc.output(), re.M)
    assert m, f"{proc.name}: no line /{pattern}/:\n{proc.tail()}"
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")


def error_lines(proc: Proc) -> list[str]:
    return [line for line in proc.output().splitlines() if "error:" in line]


@pytest.fixture(scope="module")
def shared() -> Iterator[Callable[[str], tuple[Proc, int, int]]]:
    """One server per update mode for the pause cases, each case a rank of its own (a server
    whose trainers come and go is what is tested): ``(server, port, rank)``."""
    group = ProcessGroup()
    servers: dict[str, tuple[Proc, int]] = {}
    ranks: dict[str, int] = {}

    def get(update: str) -> tuple[Proc, int, int]:
        if update not in servers:
            port = free_port()
            servers[update] = group.server(port, "--model", "mlp", "--trainer-timeout", "2", "--update", update,
                                           "--sync-trainers", "2"), port
        server, port = servers[update]
        assert server.running(), server.tail()
        rank = ranks[update] = ranks.get(update, -1) + 1
        assert rank < SHARDS
        return server, port, rank

    try:
        yield get
    finally:
        group.kill_all()


PAUSE_CASES = [  # every pair of (update, step), (step, reconnect) and (update, reconnect) once: 8 runs, not 16
    ("async", "plain", True), ("sync", "plain", False), ("sync", "chained", True), ("async", "chained", False),
    ("async", "pull", True), ("sync", "pull", False), ("sync", "pushpull", True), ("async", "pushpull", False),
]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("update", "step", "reconnect"), PAUSE_CASES,
                         ids=[f"{u}-{s}-{'reconnect' if r else 'exit'}" for u, s, r in PAUSE_CASES])
def test_a_trainer_paused_past_the_timeout_learns_it_was_evicted(procs, shared, update, step, reconnect):
    """SIGSTOP until the server evicts the trainer, then SIGCONT: its next call tells it. With
    ``--reconnect`` it rejoins under a fresh name at once and finishes; without, one line and
    exit 3. Every step protocol (``plain`` used to die of "Could not find autograd context";
    ``--reconnect`` retried forever: dist_autograd's container keeps the first RPC id)."""
    server, port, rank = shared(update)
    t = procs.trainer(port, rank, *RUN, "--step", step, *(["--reconnect"] if reconnect else []), env=DELAY)
    name = t.wait_for(JOINED, timeout=60).group(1)
    t.wait_for(r"training samples, \d+ steps", timeout=30)
    time.sleep(0.3)
    t.signal(signal.SIGSTOP)
    server.wait_for(rf"trainer {name} missed heartbeats .* marking it LOST", timeout=20)
    t.signal(signal.SIGCONT)
    if reconnect:
        assert t.wait(60) == 0, t.tail()
        out = t.output()
        assert f"{name} was evicted by the psserver at 127.0.0.1:{port}: rejoining under a fresh name" in out, out
        again = re.search(r"reconnected as (trainer_\d+_\d+) at global step \d+ \(attempt 1\)", out)
        assert again and again.group(1) != name, out
        assert len(re.findall(rf"--step {step}\b", out)) == 2 and f"rank {rank} accuracy 0." in out, out
        server.wait_for(rf"trainer {again.group(1)} \(rank {rank}\) left after 64 steps", timeout=10)
    else:
        assert t.wait(30) == 3, t.tail()
        assert error_lines(t) == [
            f"psserver train: error: {name} was evicted by the psserver at 127.0.0.1:{port} (no sign of life within "
            "its --trainer-timeout, or a gradient it would not keep); use --reconnect to rejoin"], t.output()
    assert "Traceback" not in t.output()
    assert server.running(), server.tail()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trainer_slow_to_set_up_its_step_after_the_join_is_not_evicted(procs, port):
    """Heartbeats start with the join's answer: a trainer whose step protocol takes 3 s to set up
    (plain's DistributedOptimizer on a loaded host) keeps a 1 s --trainer-timeout (a CI run:
    evicted before its first step)."""
    server = procs.server(port, "--model", "mlp", "--trainer-timeout", "1", "--compute", "server")
    t = procs.trainer(port, 0, "--max-steps", "5", env=slow_protocol_setup(3.0))
    assert t.wait(90) == 0, t.tail()
    assert "missed heartbeats" not in server.output(), server.tail()
    took = stamp(t, "joined psserver") - stamp(t, "transport cpu")
    assert took.total_seconds() >= 3.0, t.tail()  # the slow set-up happened (after the answer)


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_preempted_trainer_leaves_and_the_sync_round_goes_on(procs, port, sig, code):
    """What Kubernetes and Slurm send on preemption: the trainer finishes its step, hands in its
    last gradient, leaves (the server logs it LEFT, not LOST after 30 s) and exits 128 + the
    signal; the other trainer's rounds stop waiting for it at once."""
    server = procs.server(port, "--model", "mlp", "--update", "sync", "--sync-trainers", "2",
                          "--trainer-timeout", "30")
    common = ["--num-trainers", "2", "--batch-size", "16"]
    delay = slow_steps(0.02)
    t0 = procs.trainer(port, 0, *common, "--epochs", "2", "--max-steps", "150", env=delay)
    t1 = procs.trainer(port, 1, *common, "--epochs", "100", env=delay)
    for t in (t0, t1):
        t.wait_for(r"training samples, \d+ steps", timeout=60)
    time.sleep(1.0)
    t1.signal(sig)
    assert t1.wait(20) == code, t1.tail()
    gone = time.monotonic()
    m = re.search(rf"received {sig.name}: handing in step (\d+) and leaving psserver \(exit {code}\)", t1.output())
    assert m, t1.tail()
    server.wait_for(rf"trainer trainer_1_1 \(rank 1\) left after {m.group(1)} steps", timeout=10)
    assert "missed heartbeats" not in server.output()
    assert t0.wait(15) == 0, t0.tail()
    assert time.monotonic() - gone < 10, "the sync round waited for the trainer that left"
    for t in (t0, t1):
        assert "Traceback" not in t.output() and not error_lines(t), t.output()
    assert procs.stop(server) == 0, server.tail()


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.timeout(120)
def test_a_crashed_trainer_restarted_at_once_rejoins_and_a_duplicate_is_refused(procs, port):
    """An Indexed Job restarts a failed pod at once, with the same rank, well within a 30 s
    ``--trainer-timeout``: the server finds the dead holder (its pipe is broken) and admits the
    new one at once. A second trainer for the rank of a live holder: one line, exit 2."""
    server = procs.server(port, "--model", "mlp", "--trainer-timeout", "30")
    args = ["--num-trainers", "2", "--epochs", "100"]
    started = time.monotonic()
    first = procs.trainer(port, 1, *args, env=DELAY)
    first.wait_for(JOINED, timeout=60)
    baseline = time.monotonic() - started  # a join and the interpreter's start, on this machine now
    first.signal(signal.SIGKILL)
    first.wait(10)
    started = time.monotonic()
    again = procs.trainer(port, 1, *args, env=DELAY)
    assert again.wait_for(JOINED, timeout=30).group(1) == "trainer_1_2"
    took = time.monotonic() - started
    assert took < baseline + 2.0, (took, baseline)
    server.wait_for(r"evicting trainer trainer_1_1: its RPC connection is broken \(.*\) and a trainer asked for rank 1",
                    timeout=5)
    duplicate = procs.trainer(port, 1, *args)
    assert duplicate.wait(60) == 2, duplicate.tail()
    assert error_lines(duplicate) == [
        "psserver train: error: rank 1 is already taken by live trainer trainer_1_2"], duplicate.output()
    assert "Traceback" not in duplicate.output()
    assert again.running()
    assert procs.stop(again) == 143, again.tail()
    server.wait_for(r"trainer trainer_1_2 \(rank 1\) left after", timeout=10)
    assert procs.stop(server) == 0, server.tail()


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.timeout(180)
def test_a_trainer_rejoins_a_restarted_server_on_its_first_try(procs, port, tmp_path):
    """The server is SIGKILLed and restarted with ``--resume`` on the same port: the trainer's
    first try once the server serves succeeds (it used to fail until a try happened to draw the
    trainer's old RPC id, for dist_autograd, 6 tries and 29 s here)."""
    common = ["--model", "mlp", "--checkpoint-dir", str(tmp_path), "--trainer-timeout", "2"]
    server = procs.server(port, *common, "--checkpoint-every", "5")
    # The trainer's RPC id here is 4, not the 1 that the restarted server hands out first: a
    # process that had to keep its id would need four tries (one per id, with backoff). Three
    # admitted joins that never join the group take ids 1-3.
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    assert [request_admission(store, rank, "test")[0] for rank in (10, 11, 12)] == [1, 2, 3]
    del store
    t = procs.trainer(port, 0, "--max-steps", "150", "--reconnect", "--rpc-timeout", "10",
                      env=slow_steps(0.02))
    t.wait_for(JOINED, timeout=60)
    server.wait_for(r"checkpoint step [1-9]\d* written", timeout=60)
    server.signal(signal.SIGKILL)
    server.wait(10)
    t.wait_for(r"lost .*: reconnecting", timeout=30)
    again = procs.server(port, *common, "--resume")
    m = t.wait_for(r"reconnected as trainer_0_\d+ at global step [1-9]\d* \(attempt (\d+)\)", timeout=60)
    assert m.group(1) == "1", t.tail()
    assert len(re.findall(r"rejoining psserver", t.output())) == 1, t.tail()
    waited = stamp(t, "reconnected as") - stamp(again, r"serving mlp on")
    assert waited.total_seconds() < 4, waited
    assert t.wait(120) == 0, t.tail()
    assert "Traceback" not in t.output()
    assert procs.stop(again) == 0, again.tail()
