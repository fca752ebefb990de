"""Batches through a DataLoader: DistributedSampler semantics for map-style data, resuming
mid-epoch by slicing the sampler, IterableDataset sharding by rank and worker, checks of samples."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, TensorDataset

from psserver.data import Batches, ShardInfo, check_batch, check_samples, shard_info
from psserver.errors import DataError

N = 103  # not a multiple of the batch or of the trainers: DistributedSampler pads, the last batch is short
BS = 8


def tensors(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 3), torch.arange(n))


class Pairs(Dataset):
    """A user's map-style dataset: sample i is ``(input, i)`` with an input of the given kind."""

    def __init__(self, n: int = N, kind: str = "tensor") -> None:
        self.n, self.kind = n, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.full((2,), float(i))
        if self.kind == "tuple":
            return (x, torch.tensor([i, i])), i
        if self.kind == "dict":
            return {"a": x, "b": torch.tensor(i)}, i
        return x, i


def targets(batches) -> list[int]:
    return [int(t) for _, y in batches for t in y]


@pytest.mark.parametrize("dataset", [tensors(), Pairs()], ids=["TensorDataset", "user"])
@pytest.mark.parametrize("workers", [0, 2])
def test_shards_are_distributed_samplers_by_rank_and_epoch(dataset, workers):
    for rank in range(3):
        batches = Batches(dataset, name="t", batch_size=BS, rank=rank, num_replicas=3, seed=7, workers=workers)
        try:
            sampler = DistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=True, seed=7, drop_last=False)
            assert batches.samples_per_epoch == len(sampler) and batches.steps_per_epoch == -(-len(sampler) // BS)
            for epoch in (0, 1, 0):
                sampler.set_epoch(epoch)
                got = list(batches.epoch(epoch))
                assert len(got) == batches.steps_per_epoch
                assert targets(got) == list(sampler)
                assert all(len(y) == BS for _, y in got[:-1])
        finally:
            batches.close()


@pytest.mark.parametrize("dataset", [tensors(), Pairs()], ids=["TensorDataset", "user"])
def test_a_rejoin_continues_its_epoch_without_loading_the_batches_done(dataset, monkeypatch):
    whole = list(Batches(dataset, name="t", batch_size=BS, rank=1, num_replicas=2, seed=3).epoch(2))
    loaded: list[int] = []
    cls = type(dataset)
    real = cls.__getitem__

    def counting(self, i):
        loaded.extend(i.tolist() if isinstance(i, torch.Tensor) else [i])
        return real(self, i)

    monkeypatch.setattr(cls, "__getitem__", counting)
    resumed = list(Batches(dataset, name="t", batch_size=BS, rank=1, num_replicas=2, seed=3).epoch(2, 4))
    assert targets(resumed) == targets(whole[4:])
    assert sorted(loaded) == sorted(targets(whole[4:]))  # nothing of the first 4 batches was read


def test_a_tensor_dataset_is_indexed_once_per_batch_and_gives_its_inputs():
    x = torch.randn(10, 3)
    one = list(Batches(TensorDataset(x, torch.arange(10)), name="t", batch_size=4, shuffle=False).epoch(0))
    assert [len(y) for _, y in one] == [4, 4, 2] and torch.equal(one[0][0], x[:4])
    # Several input tensors (ids and dense features of a recommendation set): a tuple.
    ids, dense = torch.arange(20).view(10, 2), torch.randn(10, 5)
    (xb, _), *_ = Batches(TensorDataset(ids, dense, torch.ones(10)), name="t", batch_size=4, shuffle=False).epoch(0)
    assert isinstance(xb, tuple) and torch.equal(xb[0], ids[:4]) and torch.equal(xb[1], dense[:4])


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_collated_inputs_keep_their_kind(kind):
    (x, y), *_ = Batches(Pairs(10, kind), name="t", batch_size=4, shuffle=False).epoch(0)
    if kind == "tuple":
        assert isinstance(x, tuple) and x[0].shape == (4, 2) and x[1].shape == (4, 2)
    else:
        assert set(x) == {"a", "b"} and x["a"].shape == (4, 2) and x["b"].shape == (4,)
    assert y.tolist() == [0, 1, 2, 3]
    check_batch(x, y, "t")


class Stream(IterableDataset):
    """A user's IterableDataset that shards itself with psserver.data.shard_info()."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __iter__(self):
        info = shard_info()
        mine = [i for i in range(self.n) if i % info.num_shards == info.shard]
        for i in mine[info.skip:]:
            yield torch.tensor([float(i), float(info.epoch)]), i


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_dataset_shards_itself_by_rank_and_worker(workers):
    seen: list[int] = []
    for rank in range(2):
        batches = Batches(Stream(), name="s", batch_size=BS, rank=rank, num_replicas=2, workers=workers)
        assert batches.steps_per_epoch is None
        got = list(batches.epoch(3))
        batches.close()
        assert all(int(x[0, 1]) == 3 for x, _ in got)  # the epoch reached the workers
        mine = targets(got)
        shards = max(workers, 1) * 2
        assert all(i % shards in range(rank * max(workers, 1), (rank + 1) * max(workers, 1)) for i in mine)
        seen += mine
    assert sorted(seen) == list(range(N))  # disjoint, and together everything


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_dataset_resumes_by_skipping_what_each_worker_gave(workers):
    whole = targets(Batches(Stream(), name="s", batch_size=BS, rank=0, num_replicas=1, workers=workers).epoch(0))
    resumed = targets(Batches(Stream(), name="s", batch_size=BS, rank=0, num_replicas=1, workers=workers).epoch(0, 3))
    # The same samples as the rest of the epoch; with workers the DataLoader takes the next
    # batch from worker 0 again, so the order of the workers' batches may differ.
    assert (resumed if workers == 0 else sorted(resumed)) == (whole[3 * BS:] if workers == 0 else
                                                             sorted(whole[3 * BS:]))


def test_shard_info_outside_a_trainer_is_the_whole_stream():
    import psserver.data.loader as loader

    saved, loader._reading = loader._reading, None
    try:
        assert shard_info() == ShardInfo()
        assert (ShardInfo().shard, ShardInfo().num_shards) == (0, 1)
    finally:
        loader._reading = saved
    assert (ShardInfo(rank=1, num_replicas=2, worker=1, num_workers=3).shard, ShardInfo(num_replicas=2,
                                                                                        num_workers=3).num_shards) \
        == (4, 6)


def test_a_held_out_set_is_read_whole_and_in_order():
    batches = Batches(Pairs(), name="t", batch_size=10, shuffle=False)
    assert targets(batches.epoch(0)) == list(range(N))


class Broken(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        if i == 2:
            raise OSError(f"cannot read file {i}.png")
        return torch.zeros(2), 0


@pytest.mark.parametrize("workers", [0, 1])
def test_a_failing_read_is_one_line(workers):
    batches = Batches(Broken(), name="mypkg:Broken", batch_size=2, shuffle=False, workers=workers)
    with pytest.raises(DataError, match=r"^dataset mypkg:Broken: reading batch 1 of epoch 0 failed: "
                                        r"(OSError: )?cannot read file 2.png$"):
        list(batches.epoch(0))
    batches.close()


class Samples(Dataset):
    def __init__(self, sample, n: int = 3) -> None:
        self.sample, self.n = sample, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.sample


@pytest.mark.parametrize(("dataset", "match"), [
    (Samples(torch.zeros(3)), r"sample 0 is a Tensor, not an \(input, target\) pair"),
    (Samples((torch.zeros(3), 1, 2)), r"sample 0 is a tuple of 3, not an \(input, target\) pair"),
    (Samples(("text", 1)), r"the input of sample 0 is a str; it must be a tensor, or a tuple or dict of tensors"),
    (Samples(({"a": "x"}, 1)), r"the input of sample 0 is a dict"),
    (Samples((torch.zeros(3), 1), n=0), r"dataset d is empty"),
    (TensorDataset(torch.zeros(0, 2), torch.zeros(0)), r"dataset d is empty"),
    (TensorDataset(torch.zeros(3, 2)), r"TensorDataset of 1 tensor\(s\)"),
])
def test_bad_samples_are_one_line(dataset, match):
    with pytest.raises(DataError, match=match):
        check_samples(dataset, "d")


def test_a_length_no_host_could_index_is_one_line():
    huge = Samples((torch.zeros(3), 1), n=10**15)
    match = (r"^dataset d has 1e\+15 samples by its __len__: an epoch's order of them would take 5.96e\+07 GiB, more "
             r"than the .* GiB this host has available \(an IterableDataset streams them instead\)$")
    with pytest.raises(DataError, match=match):
        check_samples(huge, "d")
    with pytest.raises(DataError, match=match):
        Batches(huge, name="d", batch_size=2)


def test_bad_batches_are_one_line():
    with pytest.raises(DataError, match=r"a batch's input is a str"):
        check_batch("x", torch.zeros(2), "d")
    with pytest.raises(DataError, match=r"a batch's target is a list of 2, not a tensor"):
        check_batch(torch.zeros(2), ["a", "b"], "d")
    with pytest.raises(DataError, match=r"batch 0 is a Tensor, not an \(input, target\) pair"):
        Batches(Samples(torch.zeros(3)), name="d", batch_size=2).pair(torch.zeros(3))
