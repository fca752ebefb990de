"""Trainers that crash, hang, die mid-join; a server that is killed and resumes."""

from __future__ import annotations

import re
import signal
import sys
import time

import psutil
import pytest
import torch

from psserver.checkpoint import list_checkpoints, read_checkpoint
from psserver.config.ps import STEP_MODES
from psserver.control.client import ControlClient
from psserver.control.v1 import control_pb2 as pb
from tests.end_to_end import die_mid_step
from tests.procs import MNIST_ARGS, accuracy, die_in_join, die_mid_checkpoint, free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

DIE_MID_STEP_PREFIX = [sys.executable, "-m", "tests.end_to_end.die_mid_step"]


def wait_lost(server, name: str, timeout: float) -> float:
    t0 = time.monotonic()
    server.wait_for(rf"trainer {name} missed heartbeats .* marking it LOST", timeout=timeout)
    return time.monotonic() - t0


# How the second trainer goes: SIGKILL or SIGSTOP from the test at a moment in its training,
# or SIGKILL by its own hand in the middle of step DIE_AT (tests.end_to_end.die_mid_step), its gradient
# half-way to being applied: the server must then count exactly DIE_AT - 1 of its updates.
KILL, HANG, DIE_MID_STEP = "kill", "hang", "die-mid-step"
DIE_AT = 25
SHARD, EPOCHS, BATCH = 4000, 3, 64  # MNIST_ARGS (--train-split 8000) over --num-trainers 2; 3 epochs to the bar
STEPS_PER_EPOCH = -(-SHARD // BATCH)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "how,update,flags,step",
    # (A SIGKILL of an async plain trainer was a case of its own: the kill of a chained one and
    # the deaths mid-step of pull and pushpull trainers cover it.)
    [(HANG, "async", ["--step", "plain"], "plain"),
     (HANG, "sync", [], "pushpull"), (KILL, "sync", ["--compute", "server"], "chained"),
     (DIE_MID_STEP, "async", ["--step", "pull"], "pull"), (DIE_MID_STEP, "sync", ["--compute", "trainer"], "pushpull")],
    ids=["hang-async", "hang-sync-trainer-compute", "kill-sync-chained", "die-mid-step-async-pull",
         "die-mid-step-sync-pushpull"],
)
def test_lost_trainer_is_evicted_and_the_other_finishes(procs, port, mnist_dir, tmp_path, how, update, flags, step):
    """Server compute (``plain``, ``chained``) and trainer compute (the default ``pushpull``,
    ``pull``): the lost trainer is evicted, the other finishes, the rank rejoins, and the server
    stops cleanly (no step of the lost trainer is left open). A hung or killed trainer's partner
    trains three epochs to the bar (plain async, pushpull sync, chained sync: the bar of each
    with a trainer lost on top); one that died mid-step is counted to the sample over one epoch."""
    ctl = free_port()
    server = procs.server(port, "--model", "mnist_cnn", "--trainer-timeout", "2", "--update", update,
                          "--sync-trainers", "2", "--checkpoint-dir", str(tmp_path), control_port=ctl)
    common = ["--num-trainers", "2", *flags, *MNIST_ARGS]
    epochs = 1 if how == DIE_MID_STEP else EPOCHS
    t0 = procs.trainer(port, 0, "--epochs", str(epochs), *common)
    if how == DIE_MID_STEP:
        t1 = procs.trainer(port, 1, "--epochs", str(epochs), *common, prefix=DIE_MID_STEP_PREFIX,
                           env={die_mid_step.ENV: str(DIE_AT)})
    else:
        t1 = procs.trainer(port, 1, "--epochs", str(epochs), *common)
    for t in (t0, t1):
        t.wait_for("joined psserver", timeout=90)
    for t in (t0, t1):
        assert f"--compute {STEP_MODES[step].compute} --step {step}" in t.output(), t.tail()
    if how == DIE_MID_STEP:
        t1.wait_for(rf"dying mid-step {DIE_AT}\n", timeout=120)
    else:
        time.sleep(3)  # mid-epoch
        t1.signal(signal.SIGKILL if how == KILL else signal.SIGSTOP)
    assert wait_lost(server, "trainer_1_1", timeout=15) < 15
    server.wait_for(r"evicted trainer_1_1 from the RPC group; RPC members: psserver,trainer_0_1\n", timeout=10)
    with ControlClient(f"127.0.0.1:{ctl}", timeout=10) as client:
        (lost,) = [tr for tr in client.list_trainers() if tr.name == "trainer_1_1"]
    assert lost.state == pb.TRAINER_STATE_LOST
    assert t0.wait(300) == 0, f"{t0.tail()}\n--- server ---\n{server.tail()}"
    if how != DIE_MID_STEP:
        assert accuracy(t0) >= 0.96
    # The rank comes back as a new incarnation and trains.
    # (--start-over: a fresh trainer of the rank, not one that continues the lost one's data.)
    again = procs.trainer(port, 1, "--num-trainers", "2", "--max-steps", "20", "--start-over", *flags, *MNIST_ARGS)
    assert again.wait(120) == 0, again.tail()
    assert "as trainer_1_2" in again.output()
    if how == HANG:
        # Its death breaks the pipe the server's retries of torch's RRef messages to it wait on;
        # the first retry comes 1 s later, the next 1.5 s after that. They once read the evicted
        # trainer's freed entry in the agent's map (SIGSEGV): the server must outlive both.
        t1.signal(signal.SIGKILL)
        t1.wait(10)
        time.sleep(3)
    assert server.running(), server.tail()
    assert procs.stop(server) == 0, server.tail()
    assert "still open" not in server.output(), server.tail()
    if how != DIE_MID_STEP:
        return
    # Exactly the lost trainer's complete steps count: DIE_AT - 1 of them (its status, its
    # samples, and in async one optimizer step each); the one it died in counts for nothing.
    assert lost.steps == DIE_AT - 1 and lost.samples == (DIE_AT - 1) * BATCH, lost
    final = read_checkpoint(list_checkpoints(tmp_path)[0])
    assert final["samples_seen"] == epochs * SHARD + (DIE_AT - 1) * BATCH + 20 * BATCH
    if update == "async":
        assert final["global_step"] == epochs * STEPS_PER_EPOCH + (DIE_AT - 1) + 20


@pytest.mark.timeout(400)
def test_ten_kill_rejoin_cycles(procs, port):
    server = procs.server(port, "--model", "mlp", "--trainer-timeout", "1.5")
    rss = []
    for i in range(1, 11):
        t = procs.trainer(port, 0, "--epochs", "1000")
        t.wait_for("joined psserver", timeout=60)
        server.wait_for(rf"trainer trainer_0_{i} \(rank 0\) joined", timeout=10)
        time.sleep(0.5)
        t.signal(signal.SIGKILL)
        t.wait(10)
        server.wait_for(rf"evicted trainer_0_{i} from the RPC group; RPC members: psserver\n", timeout=15)
        rss.append(psutil.Process(server.pid).memory_info().rss)
    assert server.running()
    # Every join succeeded with a fresh name, and nothing accumulates per cycle.
    assert len(re.findall(r"trainer trainer_0_\d+ \(rank 0\) joined", server.output())) == 10
    growth = rss[-1] - rss[1]
    assert growth < 64 * 2**20, [r // 2**20 for r in rss]
    assert procs.stop(server) == 0


@pytest.mark.timeout(300)
def test_join_that_dies_holding_the_token_blocks_nothing(procs, port):
    server = procs.server(port, "--model", "mlp", "--trainer-timeout", "2")
    dying = procs.trainer(port, 0, "--max-steps", "5", env=die_in_join())
    assert dying.wait(60) == 9, dying.tail()
    ok = procs.trainer(port, 0, "--max-steps", "20")
    assert ok.wait(120) == 0, ok.tail()
    assert "membership token held by Token_for_trainer_0_1_join" in server.output()
    t0 = time.monotonic()
    assert procs.stop(server, timeout=60) == 0
    assert time.monotonic() - t0 < 30


def _params(state):
    return {f"{i}.{k}": v for i, s in enumerate(state["shards"]) for k, v in s["module"].items()}


def _assert_same_state(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    for sa, sb in zip(a["shards"], b["shards"], strict=True):
        for (ia, ta), (ib, tb) in zip(sa["optimizer"]["state"].items(), sb["optimizer"]["state"].items(), strict=True):
            assert ia == ib
            for key in ta:
                assert torch.equal(torch.as_tensor(ta[key]), torch.as_tensor(tb[key])), key


@pytest.mark.timeout(300)
def test_killed_server_resumes_from_its_last_checkpoint(procs, port, tmp_path):
    ckdir, second = tmp_path / "ck", tmp_path / "ck2"
    common = ["--model", "mlp", "--checkpoint-dir"]
    server = procs.server(port, *common, str(ckdir), "--checkpoint-every", "20", "--optimizer", "adam")
    t = procs.trainer(port, 0, "--max-steps", "50")
    assert t.wait(120) == 0, t.tail()
    server.wait_for(r"checkpoint step 40 written", timeout=30)
    server.signal(signal.SIGKILL)
    server.wait(10)
    latest = list_checkpoints(ckdir)[0]
    assert latest.name == "ckpt-000000000040.pt"
    saved = read_checkpoint(latest)
    # Resume, then stop at once: the final checkpoint it writes must equal what it loaded.
    again = procs.server(port, *common, str(second), "--resume", str(latest))
    again.wait_for(r"resumed from .* global step 40", timeout=10)
    assert procs.stop(again) == 0
    _assert_same_state(saved, read_checkpoint(list_checkpoints(second)[0]))
    # And training continues from step 40 (trainer compute, the default, as before the kill).
    third = procs.server(port, *common, str(ckdir), "--resume")
    t = procs.trainer(port, 0, "--max-steps", "10")
    assert t.wait(120) == 0, t.tail()
    assert "--compute trainer --step pushpull" in t.output()
    assert procs.stop(third) == 0
    final = read_checkpoint(list_checkpoints(ckdir)[0])
    assert final["global_step"] == 50
    assert final["samples_seen"] == saved["samples_seen"] + 10 * 64


@pytest.mark.timeout(300)
def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(procs, port, tmp_path):
    server = procs.server(port, "--model", "mlp", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "20")
    t = procs.trainer(port, 0, "--max-steps", "20")
    assert t.wait(120) == 0, t.tail()
    server.wait_for("checkpoint step 20 written", timeout=30)
    server.signal(signal.SIGKILL)
    server.wait(10)
    good = read_checkpoint(tmp_path / "ckpt-000000000020.pt")
    dying = procs.server(port, "--model", "mlp", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "10",
                         "--resume", env=die_mid_checkpoint(4096))
    t = procs.trainer(port, 0, "--max-steps", "30")
    assert dying.wait(120) == 17, dying.tail()  # died mid-write of step 30
    t.wait(60)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000000020.pt"]
    _assert_same_state(good, read_checkpoint(tmp_path / "ckpt-000000000020.pt"))
    assert any(p.name.startswith(".ckpt-000000000030.pt.tmp") for p in tmp_path.iterdir())
    # A corrupt newer checkpoint is reported and skipped on --resume.
    corrupt = tmp_path / "ckpt-000000000099.pt"
    data = bytearray((tmp_path / "ckpt-000000000020.pt").read_bytes())
    data[-100] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    again = procs.server(port, "--model", "mlp", "--checkpoint-dir", str(tmp_path), "--resume")
    out = again.wait_for(r"resumed from \S+ckpt-000000000020.pt", timeout=10)
    assert out and "ckpt-000000000099.pt is corrupt (checksum mismatch)" in again.output()
    assert procs.stop(again) == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compute,step", [("trainer", "pushpull"), ("server", "chained")])
def test_trainer_reconnects_to_a_restarted_server(procs, port, tmp_path, compute, step):
    """The server is SIGKILLed mid-training and restarted with ``--resume``: a ``--reconnect``
    trainer continues from its checkpoint in the same compute mode, another exits with 3."""
    server = procs.server(port, "--model", "mlp", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "5")
    # 5 epochs of 64 steps: the synthetic task is learnt in a few hundred (0.5 shows the steps
    # after the reconnect landed); the first checkpoint comes at step 5, long before the end.
    t = procs.trainer(port, 0, "--epochs", "5", "--reconnect", "--rpc-timeout", "10", "--compute", compute)
    plain = procs.trainer(port, 1, "--num-trainers", "2", "--epochs", "50", "--compute", compute)
    t.wait_for("joined psserver", timeout=60)
    plain.wait_for("joined psserver", timeout=60)
    server.wait_for(r"checkpoint step [1-9]\d* written", timeout=60)  # mid-training, with a checkpoint
    server.signal(signal.SIGKILL)
    server.wait(10)
    # Without --reconnect: a clear error and a non-zero exit.
    assert plain.wait(60) == 3
    assert "lost the server at 127.0.0.1" in plain.output() and "Traceback" not in plain.output()
    t.wait_for("reconnecting", timeout=60)
    again = procs.server(port, "--model", "mlp", "--checkpoint-dir", str(tmp_path), "--resume")
    assert t.wait(180) == 0, t.tail()
    assert re.search(r"reconnected as trainer_0_\d+ at global step [1-9]", t.output()), t.tail()
    assert len(re.findall(rf"--compute {compute} --step {step}\b", t.output())) == 2, t.tail()
    assert accuracy(t) > 0.5
    assert re.search(r"trainer trainer_0_\d+ \(rank 0\) left", again.output()), again.tail()
