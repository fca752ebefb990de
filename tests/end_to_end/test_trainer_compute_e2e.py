"""Trainer compute end to end, through the real CLI and RPC: the same parameters as a local
loop, a narrow wire dtype, a server that pins where steps run, the demo."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import termios

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from psserver.checkpoint import list_checkpoints, read_checkpoint
from psserver.config.common import DataConfig
from psserver.data import load_dataset
from psserver.models import build_model, get_model_spec
from tests.procs import MNIST_ARGS, PSSERVER, ROOT, accuracy, env, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# 20 Adam steps of 256 samples over the 4,096 synthetic ones: 16 steps in epoch 0, 4 in epoch 1.
STEPS, BATCH, LR = 20, 256, 0.01


def local_loop(model_name: str, steps: int, batch_size: int, lr: float, data: DataConfig) -> dict[str, torch.Tensor]:
    """The parameters after ``steps`` Adam steps of a plain loop over the batches a single
    trainer (``psserver.trainer.loop.run_trainer``, one shard) feeds, in its order: the server's
    initial parameters (seed 0), the trainer's sampler and slicing, one thread as the trainer."""
    spec = get_model_spec(model_name)
    train_set, _ = load_dataset(data, spec.input_shape, spec.num_classes, spec.input_dtype)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=data.seed, drop_last=False)
    x_all, y_all = train_set.tensors
    steps_per_epoch = (len(sampler) + batch_size - 1) // batch_size
    model = build_model(model_name, seed=0)
    # the server's Adam (psserver.server.engine.shard.FUSED)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        done, epoch = 0, 0
        while done < steps:
            sampler.set_epoch(epoch)
            indices = torch.tensor(list(iter(sampler)))
            for b in range(min(steps_per_epoch, steps - done)):
                idx = indices[b * batch_size:(b + 1) * batch_size]
                optimizer.zero_grad()
                F.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
                optimizer.step()
                done += 1
            epoch += 1
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("step", ["pull", "pushpull"])
def test_sync_steps_equal_a_local_loop(procs, port, tmp_path, step):
    """One trainer, ``--update sync --sync-trainers 1``: the server's parameters after 20 Adam
    steps equal a local loop's over the same batches in the same order (to 1e-6)."""
    server = procs.server(port, "--model", "mlp", "--update", "sync", "--sync-trainers", "1",
                          "--checkpoint-dir", str(tmp_path))
    t = procs.trainer(port, 0, "--num-trainers", "1", "--epochs", "2", "--max-steps", str(STEPS), "--batch-size",
                      str(BATCH), "--step", step, "--optimizer", "adam", "--lr", str(LR),
                      "--compute-threads", "1")  # the local loop's one thread: the same float sums
    assert t.wait(120) == 0, t.tail()
    assert f"--compute trainer --step {step}" in t.output()
    assert f"trainer 0: step {STEPS}/{STEPS} loss" in t.output()  # --no-progress: the progress as log lines
    assert procs.stop(server) == 0, server.tail()  # SIGTERM: a final checkpoint
    state = read_checkpoint(list_checkpoints(tmp_path)[0])
    assert state["global_step"] == STEPS and state["samples_seen"] == STEPS * BATCH
    (shard,) = state["shards"]
    assert {int(s["step"]) for s in shard["optimizer"]["state"].values()} == {STEPS}
    served = shard["module"]
    expected = local_loop("mlp", STEPS, BATCH, LR, DataConfig())
    assert served.keys() == expected.keys()
    diffs = {k: float((served[k] - expected[k]).abs().max()) for k in expected}
    assert max(diffs.values()) <= 1e-6, diffs
    # And the parameters did move: 20 steps of lr 0.01 are no rounding error.
    start = build_model("mlp", seed=0).state_dict()
    assert all(float((served[k] - start[k]).abs().max()) > 1e-3 for k in start)


@pytest.mark.timeout(300)
def test_bf16_on_the_wire_trains_two_trainers_to_the_bar(procs, port, mnist_dir, tmp_path):
    """``--wire-dtype bf16``: parameters and gradients cross in bf16, the server keeps fp32
    master weights (and so its checkpoint), and two trainers still reach the bar."""
    server = procs.server(port, "--checkpoint-dir", str(tmp_path))
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--epochs", "2", "--wire-dtype", "bf16", *MNIST_ARGS)
                for r in (0, 1)]
    for t in trainers:
        assert t.wait(240) == 0, t.tail()
        assert "--compute trainer --step pushpull" in t.output(), t.tail()
        assert accuracy(t) >= 0.95, t.tail()
    assert procs.stop(server) == 0, server.tail()
    state = read_checkpoint(list_checkpoints(tmp_path)[0])
    assert state["global_step"] == 2 * 2 * 63
    assert {v.dtype for s in state["shards"] for v in s["module"].values()} == {torch.float32}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pin,refused,default", [("server", "pushpull", "chained"), ("trainer", "chained", "pushpull")])
def test_a_pinned_server_refuses_the_other_compute_and_serves_the_default(procs, port, pin, refused, default):
    """``psserver serve --compute PIN``: a trainer asking for a protocol of the other mode is
    refused (one line, exit 2); one that passes nothing gets PIN's default protocol."""
    server = procs.server(port, "--model", "mlp", "--compute", pin)
    r = run(["train", "--server", f"127.0.0.1:{port}", "--no-progress", "--max-steps", "5", "--step", refused],
            timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, r.stderr
    assert f"this server runs every step with --compute {pin}" in errors[0], errors[0]
    t = procs.trainer(port, 0, "--max-steps", "20")
    assert t.wait(120) == 0, t.tail()
    assert f"--compute {pin} --step {default}" in t.output(), t.tail()
    assert server.running()
    assert procs.stop(server) == 0, server.tail()
    out = server.output()
    assert "global step 20" in out and "Traceback" not in out


@pytest.mark.timeout(240)
def test_demo_computes_on_its_trainers():
    """``psserver demo``: a server and two trainers, trainer compute by default."""
    r = run(["demo", "--model", "mlp", "--epochs", "1"], timeout=200)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    out = r.stdout + r.stderr
    assert "(--compute trainer)" in out
    for rank in (0, 1):
        m = re.search(rf"rank {rank} accuracy ([0-9.]+)", out)
        assert m and float(m.group(1)) > 0.5, out[-3000:]


@pytest.mark.timeout(180)
def test_progress_bar_on_a_terminal(procs, port):
    """On a terminal the trainer shows a tqdm bar with its loss and samples/s."""
    server = procs.server(port, "--model", "mlp")
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal's size, not 0x0
    child = subprocess.Popen([*PSSERVER, "train", "--server", f"127.0.0.1:{port}", "--max-steps", "30"],
                             stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary, env=env(), cwd=ROOT,
                             start_new_session=True)
    os.close(secondary)
    chunks = []
    try:
        while True:
            try:
                data = os.read(primary, 65536)
            except OSError:  # EIO: every holder of the terminal has closed it
                break
            if not data:
                break
            chunks.append(data)
        assert child.wait(60) == 0
    finally:
        os.close(primary)
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
    out = b"".join(chunks).decode(errors="replace")
    assert "--compute trainer --step pushpull" in out, out[-3000:]
    assert re.search(r"trainer 0: 100%.*30/30.*loss=[0-9.]+, samples/s=[0-9]+", out), out[-3000:]
    assert procs.stop(server) == 0
