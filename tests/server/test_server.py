"""The server as a whole: drain on stop, and checkpoints in sync mode (the old deadlock)."""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest
import torch
from torch import nn

from psserver.checkpoint import list_checkpoints, read_checkpoint
from psserver.config import CheckpointConfig, OptimizerConfig, ServerConfig
from psserver.server.engine.engine import ShuttingDown
from psserver.server.server import ParameterServer


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stop_during_a_slow_step_waits_for_it_and_checkpoints_after(tmp_path):
    """resnet18 on the CPU: a step's backward takes hundreds of ms. ``stop()`` called while
    one runs waits for its update (the drain counts open steps, it does not sleep), refuses the
    trainer's next forward, then writes the final checkpoint with that update in it."""
    server = ParameterServer(ServerConfig(model="resnet18", devices=["cpu"], optimizer=OptimizerConfig(),
                                          checkpoint=CheckpointConfig(directory=tmp_path)))
    engine, half = server.engine, server.halves["chained"]
    engine.trainer_joined("t")
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    out = half.step("t", None, x).requires_grad_(True)
    (grad,) = torch.autograd.grad(nn.functional.cross_entropy(out, y), (out,))
    sending, outcome = threading.Event(), []

    def trainer() -> None:
        sending.set()
        try:
            half.step("t", grad, x)  # the backward and update of step 1, then the next forward
            outcome.append("forward ran")
        except ShuttingDown:
            outcome.append("refused")

    th = threading.Thread(target=trainer)
    th.start()
    sending.wait()
    t0 = time.monotonic()
    server.stop()
    th.join(30)
    assert outcome == ["refused"]
    assert engine.global_step == 1
    saved = read_checkpoint(list_checkpoints(tmp_path)[0])
    assert saved["global_step"] == 1 and saved["samples_seen"] == 16
    assert time.monotonic() - t0 < server.drain_timeout()


def _last_step(server_output: str) -> int:
    return int(re.findall(r"checkpoint step (\d+) written", server_output)[-1])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("step", "when", "steps"), [  # each protocol once, each trigger twice
    ("plain", ["--checkpoint-every", "5"], 20), ("chained", ["--checkpoint-interval", "1"], 20),
    ("pull", ["--checkpoint-every", "5"], 20), ("pushpull", ["--checkpoint-interval", "1"], 40),
], ids=["plain-every-5", "chained-interval-1", "pull-every-5", "pushpull-interval-1"])
def test_sync_mode_checkpoints_while_training_and_resumes(procs, port, tmp_path, step, when, steps):
    """``--update sync`` with periodic checkpoints used to hang at the first one (plain): the
    step that completed a round checkpointed while holding the round's lock. (``steps``: enough
    for a 1 s interval to pass while training: chained's server-side steps are the slow ones.)"""
    args = ["--model", "mnist_cnn", "--update", "sync", "--sync-trainers", "2", "--checkpoint-dir", str(tmp_path)]
    server = procs.server(port, *args, *when)
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--epochs", "2", "--max-steps", str(steps), "--step",
                              step, "--rpc-timeout", "30") for r in (0, 1)]
    for t in trainers:
        assert t.wait(180) == 0, t.tail()
    written_while_training = len(re.findall(r"checkpoint step \d+ written", server.output()))
    assert written_while_training >= (2 if when[0] == "--checkpoint-every" else 1), server.tail()
    assert procs.stop(server) == 0, server.tail()
    last = read_checkpoint(list_checkpoints(tmp_path)[0])
    assert last["global_step"] == _last_step(server.output()) >= steps
    assert "Traceback" not in server.output()
    again = procs.server(port, *args, "--resume")
    again.wait_for(rf"resumed from \S+ckpt-{last['global_step']:012d}\.pt: global step {last['global_step']}", 30)
    # SIGTERM that the kernel hands to another of the server's threads stops it all the same
    # (once its main thread waits for a shutdown: a CI run's server never stopped).
    time.sleep(2)
    again.signal_other_thread(signal.SIGTERM)
    assert again.wait(30) == 0, again.tail()
