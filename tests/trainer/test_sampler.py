"""``ps.sampler``: torch's DistributedSampler, and after a rejoin the rest of its epoch."""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from psserver.trainer.sampler import ResumableSampler

DATA = TensorDataset(torch.arange(100))


def trained(epoch: int, samples: int):
    """What a connection hands its samplers after a rejoin: ``samples`` of ``epoch``, taken once."""
    pending = [(epoch, samples)]

    def skip(e: int, take: bool) -> int:
        if not pending or pending[0][0] != e:
            return 0
        return pending.pop()[1] if take else pending[0][1]

    return {"skip": skip, "epoch": epoch}


def test_it_is_a_distributed_sampler_when_not_resumed():
    mine = ResumableSampler(DATA, num_replicas=3, rank=1, seed=7)
    theirs = DistributedSampler(DATA, num_replicas=3, rank=1, seed=7)
    for epoch in (0, 1):
        mine.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(mine) == list(theirs) and len(mine) == len(theirs) == 34


def test_the_resumed_epoch_skips_what_was_trained_and_the_next_is_whole():
    epochs: list[int] = []
    whole = DistributedSampler(DATA, num_replicas=2, rank=0, seed=3)
    resumed = ResumableSampler(DATA, num_replicas=2, rank=0, seed=3, **trained(1, 20), on_epoch=epochs.append)
    whole.set_epoch(1)
    resumed.set_epoch(1)
    assert len(resumed) == 30
    assert list(resumed) == list(whole)[20:]
    assert list(resumed) == list(whole)  # a second pass over the epoch is whole
    resumed.set_epoch(2)
    whole.set_epoch(2)
    assert list(resumed) == list(whole) and epochs == [1, 2]


def test_a_resume_past_the_end_of_the_shard_yields_nothing():
    resumed = ResumableSampler(DATA, num_replicas=2, rank=1, **trained(0, 500))
    assert len(resumed) == 0 and list(resumed) == []


def test_it_counts_what_it_handed_out_per_epoch_a_resumed_epochs_skip_included():
    sampler = ResumableSampler(DATA, num_replicas=2, rank=0, **trained(1, 20))
    it = iter(sampler)
    for _ in range(5):
        next(it)
    assert sampler.handed_out(1) == 25 and sampler.handed_out(0) == 0
    list(it)
    list(sampler)  # a second pass over the same epoch
    assert sampler.handed_out(1) == 100
    sampler.set_epoch(2)
    assert sampler.handed_out(2) == 0
    list(sampler)
    assert sampler.handed_out(2) == 50 and sampler.handed_out(1) == 0


def test_the_skip_goes_to_the_first_sampler_through_the_epoch_only():
    """A training sampler and a held-out one made by ``ps.sampler`` after a rejoin: the held-out
    one is whole (it skipped the training data's count, and a metric divided by its length)."""
    shared = trained(0, 20)
    train = ResumableSampler(DATA, num_replicas=2, rank=0, **shared)
    held_out = ResumableSampler(DATA, num_replicas=2, rank=0, shuffle=False, **shared)
    assert len(list(train)) == 30
    assert len(held_out) == 50 and len(list(held_out)) == 50
