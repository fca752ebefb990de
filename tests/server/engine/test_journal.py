"""Each trainer's gradients numbered: one sent again is applied once, even when its trainer was
evicted while its sync round was still open and rejoined after the round closed."""

from __future__ import annotations

from psserver.server.engine.journal import GradientSequences
from psserver.server.engine.sync_updates import SyncUpdater
from tests.server.engine.test_updates import grads, make_shard


def test_a_gradient_left_in_an_open_round_by_an_evicted_trainer_is_applied_once():
    shard = make_shard()
    updater = SyncUpdater([shard], lambda s, n: None, k=2)
    sequences = GradientSequences()
    updater.journal = sequences
    for rank, t in enumerate(("a", "b", "c")):
        sequences.joined(t, rank, 0)
        updater.trainer_joined(t)
    assert not sequences.applied_before("a", 5)
    updater.submit("a", grads(shard, 1.0), 4)  # its round waits for another
    sequences.gone("a")  # evicted while it waited; its reply never came
    updater.trainer_gone("a")
    assert not sequences.applied_before("b", 1)
    updater.submit("b", grads(shard, 1.0), 4)  # the round closes with a's gradient in it
    assert updater.global_step == 1 and sequences.applied == {0: 5, 1: 1}
    sequences.joined("a", 0, 4)  # rejoined (--reconnect): its step 5 is sent again
    assert sequences.applied_before("a", 5)


def test_a_trainer_gone_after_its_gradient_was_applied_leaves_nothing_behind():
    shard = make_shard()
    updater = SyncUpdater([shard], lambda s, n: None, k=1)
    sequences = GradientSequences()
    updater.journal = sequences
    sequences.joined("a", 0, 0)
    updater.trainer_joined("a")
    assert not sequences.applied_before("a", 1)
    updater.submit("a", grads(shard, 1.0), 4)
    sequences.gone("a")
    assert sequences.applied == {0: 1} and sequences._departed == {}


def test_a_fresh_trainer_on_the_rank_of_one_that_left_a_gradient_in_an_open_round_keeps_its_own_numbers():
    """The gradient left in the round is of the trainer gone; a fresh trainer on its rank
    (numbers from 1 again) must not find its steps counted as applied when the round closes."""
    shard = make_shard()
    updater = SyncUpdater([shard], lambda s, n: None, k=4)
    sequences = GradientSequences()
    updater.journal = sequences
    for rank, t in enumerate(("a", "b", "c", "d")):
        sequences.joined(t, rank, 0)
        updater.trainer_joined(t)
    assert not sequences.applied_before("b", 8)
    updater.submit("b", grads(shard, 1.0), 4)
    sequences.gone("b")  # killed, its gradient 8 in the open round
    updater.trainer_gone("b")
    sequences.joined("b2", 1, 0)  # a fresh trainer takes rank 1
    updater.trainer_joined("b2")
    for t in ("a", "c", "d"):  # the round closes: b's gradient and these three
        assert not sequences.applied_before(t, 1)
        updater.submit(t, grads(shard, 1.0), 4)
    assert updater.global_step == 1 and sequences.applied.get(1, 0) < 2
    assert not sequences.applied_before("b2", 2)
