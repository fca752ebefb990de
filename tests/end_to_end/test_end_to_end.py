"""A real server and real trainers, through the CLI: each step protocol and update mode trained
to an accuracy bar on the real MNIST split where no other test holds it there, and counted to
the step on a small run where one does."""

from __future__ import annotations

import pytest
import torch

from psserver.checkpoint import list_checkpoints, read_checkpoint
from psserver.models import build_model
from tests.procs import MNIST_ARGS, accuracy, cli, metric

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

def _train_two(procs, port, *extra, epochs: int = 3):
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--epochs", str(epochs), *MNIST_ARGS, *extra)
                for r in (0, 1)]
    for t in trainers:
        assert t.wait(240) == 0, t.tail()
    return trainers


# A small run where the bar is held elsewhere: mlp on the synthetic data, 20 steps a trainer
# (inside the first epoch of its 2048-sample shard), so that the server's count is exact.
SMALL_STEPS = 20


def _step_two(procs, port, *extra):
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--max-steps", str(SMALL_STEPS), *extra)
                for r in (0, 1)]
    for t in trainers:
        assert t.wait(120) == 0, t.tail()
    return trainers


@pytest.mark.timeout(300)
def test_plain_sync_counts_every_step_and_the_server_keeps_serving(procs, port):
    """The reference protocol (``--step plain``: dist_autograd and DistributedOptimizer), in
    sync rounds of two: every step of both trainers counted. (Plain trainers reach the bar in
    async, and a rank rejoins as a new incarnation with a trainer lost on top, in
    tests/end_to_end/test_failures.py's hang-async case.)"""
    server = procs.server(port, "--model", "mlp", "--update", "sync", "--sync-trainers", "2")
    for t in _step_two(procs, port, "--step", "plain"):
        assert "--compute server --step plain" in t.output(), t.tail()
    for rank in (0, 1):
        server.wait_for(rf"trainer trainer_{rank}_1 \(rank {rank}\) left after {SMALL_STEPS} steps", timeout=10)
    assert server.running()
    # The server outlives its trainers: a third one joins (rank 0 again, a new incarnation).
    # It computes on the trainer (the default), after two trainers that computed on the server.
    third = procs.trainer(port, 0, "--num-trainers", "2", "--max-steps", "10")
    assert third.wait(120) == 0, third.tail()
    assert "as trainer_0_2" in third.output() and "--compute trainer --step pushpull" in third.output()
    assert server.running()
    assert procs.stop(server) == 0
    out = server.output()
    assert "trainer trainer_0_1 (rank 0) joined" in out and "trainer trainer_0_1 (rank 0) left" in out


@pytest.mark.timeout(420)
def test_adam_has_one_optimizer_state_per_shard(procs, port, mnist_dir, tmp_path):
    server = procs.server(port, "--model", "mnist_cnn", "--optimizer", "adam", "--checkpoint-dir", str(tmp_path),
                          "--devices", "cpu,cpu")
    trainers = [
        procs.trainer(port, r, "--num-trainers", "2", "--max-steps", "40", "--step", "plain", *MNIST_ARGS)
        for r in (0, 1)
    ]
    for t in trainers:
        assert t.wait(180) == 0, t.tail()
    assert procs.stop(server) == 0  # SIGTERM writes a final checkpoint
    state = read_checkpoint(list_checkpoints(tmp_path)[0])
    assert state["global_step"] == 80  # async: every trainer step is one optimizer step
    assert len(state["shards"]) == 2
    # One Adam state per parameter tensor of the model, split over the two shards, each
    # advanced by BOTH trainers' steps: two per-trainer optimizers would each count 40.
    n_params = len(list(build_model("mnist_cnn").parameters()))
    assert sum(len(s["optimizer"]["state"]) for s in state["shards"]) == n_params
    for shard in state["shards"]:
        opt = shard["optimizer"]
        assert len(opt["param_groups"]) == 1
        assert len(opt["state"]) == len(opt["param_groups"][0]["params"]) > 0
        for st in opt["state"].values():
            assert int(st["step"]) == 80
            assert set(st) >= {"exp_avg", "exp_avg_sq"}
    # Exported, the two stages' keys are the model's own again.
    r = cli(["export", str(tmp_path), "--out", str(tmp_path / "model.pt")])
    assert r.returncode == 0, r.stderr
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    model = build_model("mnist_cnn")
    model.load_state_dict(exported, strict=True)
    stage1 = state["shards"][1]["module"]
    assert torch.equal(exported["7.weight"], stage1[next(k for k in stage1 if k.endswith("weight"))])


@pytest.mark.timeout(300)
def test_two_stages_count_every_step(procs, port):
    """Two server shards with the default, trainer compute: one flat buffer per shard each way,
    every step applied once on both (the bar of this protocol is one shard's, held by the ssp
    and sync tests: the arithmetic per shard is the same)."""
    server = procs.server(port, "--model", "mnist_cnn", "--devices", "cpu,cpu")  # stages need the model's code
    assert "in 2 stage(s) on cpu, cpu" in server.output()
    for t in _step_two(procs, port):
        assert "--compute trainer --step pushpull" in t.output(), t.tail()
    assert procs.stop(server) == 0
    assert f"global step {2 * SMALL_STEPS}" in server.output(), server.tail()  # async: one per trainer step


@pytest.mark.timeout(300)
def test_chained_async_counts_every_step(procs, port):
    """Server compute's default, ``--step chained``, in async: the server pins ``--compute
    server`` and the trainers pass nothing; the final flush lands every update. (Chained trainers
    reach the bar in tests/end_to_end/test_failures.py's kill-sync-chained case, and chained
    sync counts its rounds below.)"""
    server = procs.server(port, "--model", "mnist_cnn", "--update", "async", "--compute", "server")
    for t in _step_two(procs, port):
        assert "--compute server --step chained" in t.output(), t.tail()
    assert procs.stop(server) == 0
    assert f"global step {2 * SMALL_STEPS}" in server.output(), server.tail()


@pytest.mark.timeout(300)
def test_chained_sync_flushes_every_round(procs, port):
    """Chained sync: the trainers ask for ``--compute server``; the final flush lands every
    round, one optimizer step per round of two."""
    server = procs.server(port, "--model", "mlp", "--update", "sync", "--sync-trainers", "2")
    for t in _step_two(procs, port, "--compute", "server"):
        assert "--compute server --step chained" in t.output(), t.tail()
    assert procs.stop(server) == 0
    assert f"global step {SMALL_STEPS}" in server.output(), server.tail()


# The bar for trainer compute, and the global steps of 2 trainers x 3 epochs x 63 steps:
# one optimizer step per trainer step (ssp).
TRAINER_COMPUTE_BAR = 0.97


@pytest.mark.timeout(420)
# Async, the default, trains mnist_cnn to this bar with two trainers, its steps and samples
# counted exactly across three server deaths, in tests/server/state/test_supervisor.py; sync, in
# tests/end_to_end/test_failures.py's hang-sync-trainer-compute case (and its rounds are counted below).
def test_trainer_compute_reaches_the_bar_in_ssp(procs, port, mnist_dir):
    """``--compute trainer`` (its default protocol, ``pushpull``): each trainer runs the model
    on flat parameters it gets back for its flat gradient; the server only applies the
    gradients. ``ssp`` with S = 2: no trainer more than two steps ahead of the other. (With
    ``--overlap on`` as well, one CI run reached 0.9655 here, under this bar: overlap is shown at
    the bar in async, tests/server/state/test_supervisor.py, and is not ssp's default.)"""
    server = procs.server(port, "--update", "ssp", "--staleness", "2")
    assert "(update=ssp" in server.output()
    for t in _train_two(procs, port, "--compute", "trainer"):
        assert "--compute trainer --step pushpull" in t.output(), t.tail()
        assert "gradient buckets: 0 of 2 go ahead of the step's call" in t.output(), t.tail()
        assert accuracy(t) >= TRAINER_COMPUTE_BAR, t.tail()
    assert procs.stop(server) == 0
    assert "global step 378" in server.output(), server.tail()


@pytest.mark.timeout(300)
def test_trainer_compute_sync_sends_large_buckets_ahead_and_counts_every_round(procs, port):
    """Sync sends its gradients' large buckets ahead, as backward fills them: with 1 MiB buckets
    mnist_cnn's 4.7 MB fc1.weight goes to the server in a part of its own while backward still
    runs (on the synthetic data, made to its input's shape); the round count shows every step
    landed once."""
    server = procs.server(port, "--model", "mnist_cnn", "--update", "sync", "--sync-trainers", "2")
    assert "(update=sync" in server.output()
    for t in _step_two(procs, port, "--compute", "trainer", "--bucket-cap-mb", "1"):
        assert "--compute trainer --step pushpull" in t.output(), t.tail()
        assert "gradient buckets: 1 of 3 go ahead of the step's call" in t.output(), t.tail()
    assert procs.stop(server) == 0
    assert f"global step {SMALL_STEPS}" in server.output(), server.tail()


@pytest.mark.timeout(420)
def test_pull_reaches_the_bar(procs, port, mnist_dir):
    """``--step pull``, trainer compute's reference (parameters pulled inside
    ``dist_autograd``), in sync mode (async: tests/end_to_end/test_failures.py's die-mid-step-async-pull
    trains its surviving trainer with it, counted to the sample)."""
    server = procs.server(port, "--update", "sync", "--sync-trainers", "2")
    for t in _train_two(procs, port, "--step", "pull"):
        assert "--compute trainer --step pull" in t.output(), t.tail()
        assert accuracy(t) >= TRAINER_COMPUTE_BAR, t.tail()
    assert procs.stop(server) == 0
    assert "global step 189" in server.output(), server.tail()


@pytest.mark.timeout(300)
def test_a_byte_level_language_model_learns_the_standard_librarys_sources(procs, port):
    """``byte_lm`` on ``--dataset pysource``: logits at every position, the next-token loss, the
    held-out loss as the metric; 20 steps take the held-out loss well under a uniform guess's
    ln 256 = 5.55 nats a byte (about 3.1 in a trial)."""
    server = procs.server(port, "--model", "byte_lm")
    t = procs.trainer(port, 0, "--num-trainers", "1", "--max-steps", "20", "--batch-size", "16", "--dataset",
                      "pysource", "--train-samples", "2048", "--eval-samples", "64")
    assert t.wait(180) == 0, t.tail()
    assert metric(t, "loss") < 4.0, t.tail()
    assert procs.stop(server) == 0
    assert "global step 20" in server.output(), server.tail()
