"""``ps.sampler``: torch's DistributedSampler, and after a rejoin the rest of its epoch."""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from psserver.trainer.sampler import ResumableSampler

DATA = TensorDataset(torch.arange(100))


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
    resumed = ResumableSampler(DATA, num_replicas=2, rank=0, seed=3, resume=(1, 20), on_epoch=epochs.append)
    whole.set_epoch(1)
    resumed.set_epoch(1)
    assert len(resumed) == 30
    assert list(resumed) == list(whole)[20:]
    assert list(resumed) == list(whole)  # a second pass over the epoch is whole
    resumed.set_epoch(2)
    whole.set_epoch(2)
    assert list(resumed) == list(whole) and epochs == [1, 2]


def test_a_resume_past_the_end_of_the_shard_yields_nothing():
    resumed = ResumableSampler(DATA, num_replicas=2, rank=1, resume=(0, 500))
    assert len(resumed) == 0 and list(resumed) == []


def test_it_counts_what_it_handed_out_per_epoch_a_resumed_epochs_skip_included():
    sampler = ResumableSampler(DATA, num_replicas=2, rank=0, resume=(1, 20))
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
