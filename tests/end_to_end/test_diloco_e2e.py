"""DiLoCo through the real CLI and RPC: ``serve --update diloco`` and two ``train --local-steps``
trainers; every window is one outer step's share (sync: K = 2 a round; async: one each), counted
exactly, and ``psserver status`` names the mode and its outer optimizer; a trainer of another
step protocol is refused in one line."""

from __future__ import annotations

import json
import re

import pytest

from psserver.common.fragments import fragment_groups
from psserver.models import build_model
from tests.procs import cli, die_after_update, die_at_step, free_port, metric, start_servers

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS, H = 20, 5  # four windows a trainer, inside the first epoch of its synthetic shard


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("outer", "outer_steps", "optimizer"), [
    ("sync", STEPS // H, "sgd(lr=0.7, momentum=0.9, weight_decay=0, nesterov=True)"),
    ("async", 2 * STEPS // H, "delayed_nesterov(lr=0.7, momentum=0.9, weight_decay=0, period=2)"),
])
def test_every_window_is_counted_once_and_status_shows_the_mode(procs, port, outer, outer_steps, optimizer):
    ctl = free_port()
    server = procs.server(port, "--model", "mlp", "--update", "diloco", "--outer", outer, "--sync-trainers", "2",
                          control_port=ctl)
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--max-steps", str(STEPS), "--local-steps", str(H),
                              "--inner-optimizer", "adamw", "--inner-lr", "1e-3") for r in (0, 1)]
    # Beside them, a trainer of another protocol is refused at its join, in one line. (Once they
    # have joined: a refused trainer leaves the RPC group, and a member leaving while another's
    # init_rpc calls every member fails that join with EOF, a race of torch's dynamic groups.)
    for t in trainers:
        t.wait_for("joined psserver", timeout=90)
    refused = procs.trainer(port, 2, "--num-trainers", "3", "--step", "pushpull", "--max-steps", "1")
    for t in trainers:
        assert t.wait(120) == 0, t.tail()
        assert "--compute trainer --step diloco" in t.output(), t.tail()
    assert refused.wait(60) == 2, refused.tail()
    assert "error: this server runs --update diloco" in refused.output() and "Traceback" not in refused.output()
    done = cli(["--log-level", "ERROR", "status", "--address", f"127.0.0.1:{ctl}", "--json"])
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)["status"]
    assert status["update_mode"] == "diloco" and status["global_step"] == outer_steps
    assert status["samples_seen"] == 2 * STEPS * 64  # every window's samples (batches of 64), once
    # Each window's pseudo-gradient, fp32 on the wire: mlp's parameters x 4 bytes a sync.
    ranks = {t["rank"]: t for t in json.loads(done.stdout)["trainers"] if t["name"].endswith("_1")}
    assert [ranks[r]["received_bytes"] for r in (0, 1)] == [STEPS // H * 235_146 * 4] * 2, ranks
    text = cli(["status", "--address", f"127.0.0.1:{ctl}"]).stdout
    assert f"diloco (outer {outer}" in text and optimizer in text, text
    assert procs.stop(server) == 0
    assert f"psserver stopped at global step {outer_steps}" in server.output(), server.tail()


@pytest.mark.timeout(180)
def test_streaming_fragments_each_make_their_own_rounds_and_carry_only_their_bytes(procs, port, tmp_path):
    """--fragments 2 --fragment-overlap 1 (H = 5): fragment 0 goes at inner steps 5, 10, 15, 20,
    fragment 1 at 2, 7, 12, 17 and once more at the end (3 steps since): 9 rounds of K = 2, each
    one outer step; each sync carries its fragment's values only, and the windows' samples once."""
    ctl = free_port()
    server = procs.server(port, "--model", "mlp", "--update", "diloco", "--sync-trainers", "2", control_port=ctl)
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--max-steps", str(STEPS), "--local-steps", str(H),
                              "--fragments", "2", "--fragment-overlap", "1", "--stats-out", str(tmp_path / f"{r}.json"))
                for r in (0, 1)]
    for t in trainers:
        assert t.wait(120) == 0, t.tail()
        assert "diloco: streaming 2 fragments, one every 2 inner steps, each merged 1 steps after it is sent" \
            in t.output(), t.tail()
    done = cli(["--log-level", "ERROR", "status", "--address", f"127.0.0.1:{ctl}", "--json"])
    status = json.loads(done.stdout)["status"]
    assert status["global_step"] == 9 and status["samples_seen"] == 2 * STEPS * 64
    sizes = [p.numel() for p in build_model("mlp").parameters()]
    n0, n1 = (sum(sizes[i] for i in group) for group in fragment_groups(sizes, 2))
    ranks = {t["rank"]: t for t in json.loads(done.stdout)["trainers"] if t["name"].endswith("_1")}
    assert [ranks[r]["received_bytes"] for r in (0, 1)] == [(4 * n0 + 5 * n1) * 4] * 2, ranks
    # The path the buffers took, in --stats-out (benchmarks check it against the one asked for).
    assert json.loads((tmp_path / "0.json").read_text())["transport"] == {"kind": "cpu", "fell_back": None}
    assert procs.stop(server) == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("args", "outer_steps"), [
    (("--compress", "int8"), STEPS // H),
    (("--fragments", "2", "--fragment-overlap", "1"), 9),
], ids=["whole-int8", "fragments"])
def test_two_server_processes_each_take_their_partition_of_every_window(procs, port, args, outer_steps):
    """--num-servers 2, outer sync: each window's pseudo-gradient is split by partition as
    pushpull's gradient is (here quantized to int8, each piece on its own), or each streaming
    fragment is, its part on each server (9 rounds: as on one server); every round is one outer
    step, and both trainers end on the same global weights (the last round's
    reply), so they score the same."""
    servers = start_servers(procs, port, 2, "--model", "mlp", "--update", "diloco", "--sync-trainers", "2")
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--max-steps", str(STEPS), "--local-steps", str(H),
                              *args) for r in (0, 1)]
    for t in trainers:
        assert t.wait(120) == 0, t.tail()
        if "int8" in args:
            assert re.search(r"diloco: \d+ bytes of pseudo-gradient a sync \(int8; 3\.\dx fewer than fp32\)",
                             t.output()), t.tail()
        else:
            assert "diloco: streaming 2 fragments" in t.output(), t.tail()
    assert metric(trainers[0], "accuracy") == metric(trainers[1], "accuracy")
    assert procs.stop(servers[0]) == 0
    assert f"psserver stopped at global step {outer_steps}" in servers[0].output(), servers[0].tail()


@pytest.mark.timeout(240)
def test_a_server_killed_after_an_outer_step_loses_none_and_applies_none_twice(procs, port, state_dir, tmp_path):
    """The server process SIGKILLs itself right after its 3rd outer step, before the reply: it
    comes back from its state in memory at outer step 3; the trainer whose sync lost its reply
    rejoins (--reconnect), sends that window again (applied before: not again), and goes on
    from the global weights and its 16th inner step (the 15th, counted before its sync, is not
    trained again). Its 30 inner steps: 3 windows
    before the death (steps 1-15), then 3 (steps 16-30): 6 outer steps, none applied twice."""
    sup = procs.server(port, "--model", "mlp", "--update", "diloco", "--outer", "async", "--sync-trainers", "1",
                       "--supervise", "--state-dir", str(state_dir), env=die_after_update(3, tmp_path / "died"))
    t = procs.trainer(port, 0, "--num-trainers", "1", "--max-steps", str(30), "--local-steps", str(H), "--reconnect")
    assert t.wait(180) == 0, t.tail()
    assert (tmp_path / "died").exists()
    assert re.search(r"found the state of run \S+ in memory: \S+, generation \d+, global step 3,", sup.output()), \
        sup.tail()
    assert "reconnected as" in t.output() and "Traceback" not in t.output(), t.tail()
    # The new process image sends the window of the failed sync again, under its number: the
    # restarted server had applied it (its state in memory says so), and applies it once.
    assert "diloco: sent again the window (inner steps up to 15)" in t.output(), t.tail()
    assert "sent the gradient of its step 15 again: applied before this server process started" in sup.output()
    assert procs.stop(sup) == 0, sup.tail()
    assert "psserver stopped at global step 6" in sup.output(), sup.tail()


@pytest.mark.timeout(240)
def test_a_trainer_killed_mid_window_loses_only_its_local_steps(procs, port, tmp_path):
    """Sync, K = 2: trainer 1 SIGKILLs itself as its 13th step begins (windows 1-2 handed in,
    steps 11-12 of the third only on it). The round it was in closes once it is evicted; started
    again by hand, rank 1 continues from where the server last heard of it, with the current
    global weights. Every window handed in is applied once and no other: the server's samples
    are trainer 0's 20 steps, the dead one's 2 windows and what the second process trained; its
    count of syncs is each process's windows."""
    ctl = free_port()
    server = procs.server(port, "--model", "mlp", "--update", "diloco", "--outer", "sync", "--sync-trainers", "2",
                          "--trainer-timeout", "3", control_port=ctl)
    args = ("--num-trainers", "2", "--max-steps", str(STEPS), "--local-steps", str(H))
    t0 = procs.trainer(port, 0, *args)
    dying = procs.trainer(port, 1, *args, env=die_at_step(13, tmp_path / "died"))
    assert dying.wait(120) == -9, dying.tail()
    server.wait_for(r"evicted trainer_1_1 from the RPC group", timeout=60)
    again = procs.trainer(port, 1, *args)
    for t in (t0, again):
        assert t.wait(120) == 0, t.tail()
    assert "rank 1 continues where its last trainer stopped" in again.output(), again.tail()
    # From its last sync's report (steps 1-10, each counted before it) or a later heartbeat's:
    # no step of a window handed in is trained again.
    assert int(re.search(r"continues where its last trainer stopped: .*, step (\d+)", again.output()).group(1)) \
        in (10, 11, 12), again.tail()
    mine = int(re.search(r"\((\d+) by this process\)", again.output()).group(1)) // 64  # its steps
    done = cli(["--log-level", "ERROR", "status", "--address", f"127.0.0.1:{ctl}", "--json"])
    assert done.returncode == 0, done.stderr
    status, trainers = json.loads(done.stdout)["status"], json.loads(done.stdout)["trainers"]
    assert status["samples_seen"] == (STEPS + 2 * H + mine) * 64, status
    assert sorted(t["updates"] for t in trainers) == sorted([STEPS // H, 2, -(-mine // H)]), trainers
    assert procs.stop(server) == 0
