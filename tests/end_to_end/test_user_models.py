"""A user's own model on a server that runs none of its code, through the real CLI and RPC.

The user's package lives in a directory only the trainers have on their ``PYTHONPATH``: the
server learns the model from the first trainer (layout and initial values), checks every later
trainer against it, and resumes from its checkpoint without the package."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from psserver.checkpoint import list_checkpoints, read_checkpoint
from tests.procs import MNIST_ARGS, accuracy, cli, run
from tests.userproject import BN_CNN, pythonpath, write_package

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

@pytest.fixture
def user_path(tmp_path):
    """A directory holding the user's package ``usernets``; the trainers' PYTHONPATH."""
    return {"PYTHONPATH": pythonpath(write_package(tmp_path / "user", "usernets", {"cnn": BN_CNN}))}


def refused(port: int, rank: int, user_path: dict[str, str], *args: str):
    """``psserver train`` refused at its join, in this process with the user's package on its
    path as on a trainer's (removed again afterwards)."""
    added = [d for d in user_path["PYTHONPATH"].split(os.pathsep) if d not in sys.path]
    sys.path[:0] = added
    try:
        return cli(["train", "--server", f"127.0.0.1:{port}", "--rank", str(rank), "--no-progress", *args])
    finally:
        for d in added:
            sys.path.remove(d)
        for name in [m for m in sys.modules if m == "usernets" or m.startswith("usernets.")]:
            del sys.modules[name]


@pytest.mark.timeout(420)
def test_a_server_without_the_users_code_trains_it_checks_it_and_resumes_it(procs, port, tmp_path, mnist_dir,
                                                                            user_path):
    ckpt = tmp_path / "ckpt"
    server = procs.server(port, "--checkpoint-dir", str(ckpt), "--optimizer", "adam", "--lr", "0.003",
                          "--update", "sync", "--sync-trainers", "2")
    assert "usernets" not in os.environ.get("PYTHONPATH", "")
    train = ["--num-trainers", "2", "--epochs", "1", "--batch-size", "64", *MNIST_ARGS]
    first = procs.trainer(port, 0, "--model", "usernets.cnn:BNNet", *train, env=user_path)
    server.wait_for(r"model usernets.cnn:BNNet \(\d+ parameters, 6 buffer\(s\); fingerprint \w+\) learnt from the "
                    "first trainer", timeout=90)
    # No --model: the name the first trainer sent is not code this one runs; it says what to pass.
    bare = refused(port, 1, user_path, *train)
    assert bare.returncode == 2 and "'usernets.cnn:BNNet'); psserver never runs code" in bare.stderr, bare.stderr
    second = procs.trainer(port, 1, "--model", "usernets.cnn:BNNet", *train, env=user_path)
    for t in (first, second):
        assert t.wait(300) == 0, t.tail()
        assert accuracy(t) >= 0.95, t.tail()
    assert "model usernets.cnn:BNNet" in second.output() or "usernets.cnn:BNNet" in second.output()

    # One layer wider: refused in one line naming it.
    # (a child: the join reaches init_rpc, which a process does once)
    wider = run(["train", "--server", f"127.0.0.1:{port}", "--rank", "0", "--no-progress", "--model",
                 "usernets.cnn:BNNet", "--model-args", '{"width": 48}', *train], timeout=120, env=user_path)
    assert wider.returncode == 2, wider.stderr
    err = [line for line in wider.stderr.splitlines() if "error:" in line]
    assert len(err) == 1 and "conv1.weight is [48, 1, 3, 3] float32, the server's [32, 1, 3, 3] float32" in err[0], \
        wider.stderr
    assert "Traceback" not in wider.stderr

    assert procs.stop(server) == 0, server.tail()
    final = read_checkpoint(list_checkpoints(ckpt)[0])
    assert final["model"] == "usernets.cnn:BNNet" and final["layout"]["entries"][0][0] == "conv1.weight"
    held = final["shards"][0]["module"]  # under the model's own keys
    # The server's BatchNorm statistics are the trainers' (--buffers average), not the initial ones.
    # (sync: the mean of a round's contributors, once per round)
    assert not torch.allclose(held["bn1.running_var"], torch.ones(32)) and held["bn1.num_batches_tracked"] > 20

    # Resumed without the user's package: the layout comes from the checkpoint.
    again = procs.server(port, "--checkpoint-dir", str(ckpt), "--resume")
    again.wait_for(r"model usernets.cnn:BNNet .* learnt from a checkpoint", timeout=30)
    more = procs.trainer(port, 0, "--num-trainers", "2", "--model", "usernets.cnn:BNNet", "--max-steps", "20",
                         *MNIST_ARGS, env=user_path)
    assert more.wait(180) == 0, more.tail()
    assert procs.stop(again) == 0, again.tail()
    assert read_checkpoint(list_checkpoints(ckpt)[0])["global_step"] == final["global_step"] + 20
