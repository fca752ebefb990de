"""Update modes and shard concurrency, in-process (no RPC): the logic under the server."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from psserver.config import OptimizerConfig
from psserver.ps.shard import Shard
from psserver.ps.updates import AsyncUpdater, SyncUpdater


def make_shard():
    torch.manual_seed(0)
    shard = Shard(0, nn.Sequential(nn.Linear(4, 3)), torch.device("cpu"))
    shard.init_optimizer(OptimizerConfig(name="sgd", lr=1.0))
    return shard


def grads(shard, value):
    return {p: torch.full_like(p, value) for p in shard.params}


def test_async_applies_each_gradient():
    shard = make_shard()
    before = shard.params[0].detach().clone()
    steps = []
    up = AsyncUpdater([shard], lambda s, n: steps.append((s, n)))
    up.submit("a", grads(shard, 1.0), 8)
    up.submit("b", grads(shard, 1.0), 8)
    assert steps == [(1, 8), (2, 8)]
    assert torch.allclose(shard.params[0], before - 2.0)


def test_sync_averages_k_gradients_and_barrier_follows_membership():
    shard = make_shard()
    before = shard.params[0].detach().clone()
    steps = []
    up = SyncUpdater([shard], lambda s, n: steps.append((s, n)), k=2)
    for t in ("a", "b", "c"):
        up.trainer_joined(t)
    up.submit("a", grads(shard, 1.0), 4)
    assert steps == []  # waits for a second gradient
    up.submit("b", grads(shard, 3.0), 4)
    assert steps == [(1, 8)]
    assert torch.allclose(shard.params[0], before - 2.0)  # mean of 1 and 3
    # A trainer waits for its round; the round completes when another contributes.
    up.submit("a", grads(shard, 1.0), 4)
    released = threading.Event()

    def waiter():
        up.wait_turn("a", timeout=10)
        released.set()

    th = threading.Thread(target=waiter)
    th.start()
    assert not released.wait(0.3)
    # "b" and "c" are lost: the barrier shrinks to the one live trainer and applies.
    up.trainer_gone("b")
    up.trainer_gone("c")
    assert released.wait(5)
    th.join()
    assert steps[-1] == (2, 4)
    # A trainer that joins grows it again.
    up.trainer_joined("d")
    up.submit("a", grads(shard, 1.0), 4)
    assert len(steps) == 2
    up.submit("d", grads(shard, 1.0), 4)
    assert len(steps) == 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_on_step_runs_with_the_lock_free(mode):
    """A listener may copy the shards under the updater's lock from another thread (as a
    checkpoint does on the compute thread): the updater must not hold it while it calls back.
    Holding it was the sync-mode checkpoint deadlock."""
    shard = make_shard()
    seen = []

    def take_and_release(got: list) -> None:
        if up.lock.acquire(timeout=5):
            up.lock.release()
            got.append(True)
        else:
            got.append(False)

    def on_step(step, samples):
        got: list[bool] = []
        th = threading.Thread(target=take_and_release, args=(got,))
        th.start()
        th.join()
        seen.append(got[0])

    up = AsyncUpdater([shard], on_step) if mode == "async" else SyncUpdater([shard], on_step, k=2)
    up.trainer_joined("a")
    up.trainer_joined("b")
    up.submit("a", grads(shard, 1.0), 4)
    up.submit("b", grads(shard, 1.0), 4)
    up.trainer_gone("b")
    up.submit("a", grads(shard, 1.0), 4)  # a round of one, applied at once
    assert seen == [True] * (3 if mode == "async" else 2)


def test_sync_refuses_two_gradients_from_one_trainer_in_a_round():
    shard = make_shard()
    up = SyncUpdater([shard], lambda s, n: None, k=2)
    up.trainer_joined("a")
    up.trainer_joined("b")
    up.submit("a", grads(shard, 1.0), 1)
    with pytest.raises(RuntimeError, match="two gradients"):
        up.submit("a", grads(shard, 1.0), 1)


def test_clone_forward_survives_a_concurrent_step():
    """The classic PS example crashes here: a step between forward and backward."""
    shard = make_shard()
    x = torch.randn(5, 4, requires_grad=True)  # an activation, as from an earlier stage
    out_a = shard.forward(x, clone=True)
    # Another trainer's step changes the weights in place before "a" runs its backward.
    shard.apply(grads(shard, 0.5))
    out_a.sum().backward()
    assert shard.params[0].grad is not None  # gradient reached the leaf through the clone
    # Without the clone autograd refuses.
    shard.params[0].grad = None
    out_b = shard.forward(x, clone=False)
    shard.apply(grads(shard, 0.5))
    with pytest.raises(RuntimeError, match="inplace operation"):
        out_b.sum().backward()
