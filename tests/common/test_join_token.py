"""The job's join token, and a store that strangers write to, with real processes.

With a token every key of the job lives in a namespace derived from it: a trainer without it
is told so in one line (exit 2), a stranger's ``init_rpc`` against the server's store makes a
group of its own without the server in it, and what a stranger writes to the store changes
nothing. Without a token the server still keeps the truth in its own memory: the keys it
reads are its own, put back when changed, and bounded.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys

import pytest
import torch.distributed as dist

from tests.procs import ROOT, accuracy, cli, slow_steps

TOKEN = "job-token-for-the-tests-0123456789abcdef"
JOINED = r"joined psserver \S+ as (trainer_\d+_\d+)"

STRANGER = """
import json, os, sys
import torch.distributed.rpc as rpc
port = int(sys.argv[1])
opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", _transports=["uv"], rpc_timeout=10)
rpc.init_rpc("stranger", rank=31000, world_size=None, rpc_backend_options=opts)
out = {"members": sorted(w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos())}
try:
    out["getpid"] = rpc.rpc_sync("psserver", os.getpid, timeout=10)
except Exception as e:
    out["getpid"] = "failed: " + (str(e).splitlines() or [repr(e)])[0][:200]
print(json.dumps(out), flush=True)
rpc.shutdown(graceful=False)
"""


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "join-token"
    path.write_text(TOKEN + "\n")
    return path


def train_once(port: int, rank: int, *extra: str):
    """``psserver train`` expected to be refused at its join (before ``init_rpc``), in this
    process: a refusal needs no child that spends seconds importing torch."""
    return cli(["train", "--server", f"127.0.0.1:{port}", "--rank", str(rank), "--no-progress", *extra])


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_trainer_without_the_token_is_refused_in_one_line(procs, port, tmp_path, token_file):
    procs.server(port, "--model", "mlp", "--join-token-file", str(token_file))
    wrong, empty = tmp_path / "wrong", tmp_path / "empty"
    wrong.write_text("not the token")
    empty.write_text("\n")
    run = ["--dataset", "synthetic", "--max-steps", "5", "--connect-timeout", "30"]
    cases = {  # PSSERVER_JOIN_TOKEN is hidden from cli() as from a child
        "wrong": (train_once(port, 0, *run, "--join-token-file", str(wrong)), "did not accept this join token"),
        "missing": (train_once(port, 1, *run), "needs a join token"),
        "empty": (train_once(port, 2, *run, "--join-token-file", str(empty)), "is empty"),
    }
    for name, (refused, expected) in cases.items():
        assert refused.returncode == 2, (name, refused.stderr)
        lines = [line for line in refused.stderr.splitlines() if "error:" in line]
        assert len(lines) == 1 and expected in lines[0], (name, refused.stderr)
        assert "Traceback" not in refused.stderr, name
    good = procs.trainer(port, 0, *run, env={"PSSERVER_JOIN_TOKEN": TOKEN})
    assert good.wait(60) == 0, good.tail()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_trainer_with_a_token_does_not_join_an_open_server(procs, port, token_file):
    procs.server(port, "--model", "mlp")
    r = train_once(port, 0, "--dataset", "synthetic", "--max-steps", "5", "--join-token-file", str(token_file))
    assert r.returncode == 2, r.stderr
    assert [line for line in r.stderr.splitlines() if "error:" in line] == [
        f"psserver train: error: the psserver at 127.0.0.1:{port} takes no join token, but this trainer has one: "
        "start the server with the same --join-token-file, or drop it here"], r.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_strangers_init_rpc_does_not_find_the_server(procs, port, token_file):
    """The ten-line attack: ``init_rpc`` against the server's store. Without the token the
    stranger's group is a group of its own; the server is not in it and runs nothing."""
    server = procs.server(port, "--model", "mlp", "--join-token-file", str(token_file))
    t = procs.trainer(port, 0, "--dataset", "synthetic", "--max-steps", "400", "--join-token-file", str(token_file),
                      env=slow_steps(0.02))
    t.wait_for(JOINED, timeout=60)
    r = subprocess.run([sys.executable, "-c", STRANGER, str(port)], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["members"] == ["stranger"], out
    assert str(out["getpid"]).startswith("failed:"), out
    assert t.wait(90) == 0, t.tail()
    assert "stranger" not in server.output()
    assert procs.stop(server) == 0, server.tail()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["token", "open"])
def test_store_writes_by_a_stranger_change_nothing(procs, port, token_file, mode):
    """The four tamperings seen on main before: a rank's live key, the RPC id counter at its
    limit, the server's state set back to STARTING, 50 values of 8 MB; and a join counter that
    jumps. Training goes on and a new trainer joins, with or without a token."""
    auth = ["--join-token-file", str(token_file)] if mode == "token" else []
    server = procs.server(port, "--model", "mlp", *auth)
    t0 = procs.trainer(port, 0, "--dataset", "synthetic", "--num-trainers", "2", "--max-steps", "300", *auth,
                       env=slow_steps(0.02))
    t0.wait_for(JOINED, timeout=60)
    stranger = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))
    stranger.set("psserver/live/0", "stranger")
    stranger.set("psserver/next_rpc_id", "65535")
    stranger.set("psserver/state", "STARTING")
    stranger.set("psserver/admit/seq", "1000000000")
    junk = b"\0" * (8 << 20)
    for i in range(50):
        stranger.set(f"junk/{i}", junk)
    del junk
    t1 = procs.trainer(port, 1, "--dataset", "synthetic", "--num-trainers", "2", "--max-steps", "20", *auth)
    assert t1.wait(60) == 0, t1.tail()
    assert re.search(JOINED, t1.output())
    assert t0.wait(90) == 0, t0.tail()
    assert accuracy(t0) > 0.5
    if mode == "open":  # the job's own keys: the server put its state back and followed the counter
        server.wait_for(r"store key psserver/state was changed by someone else: put back", timeout=5)
        assert "the join counter jumped" in server.output()
    assert procs.stop(server) == 0, server.tail()
