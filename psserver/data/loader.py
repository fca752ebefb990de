"""Batches of a trainer's shard, through a ``torch.utils.data.DataLoader``.

A map-style dataset is sharded by rank with ``DistributedSampler`` semantics (its indices,
``set_epoch`` each epoch, seeded by ``--data-seed``); a batch sampler hands the DataLoader one
list of indices per step, so a trainer that continues mid-epoch (a rejoin) starts at its next
batch by slicing the epoch's indices, nothing is loaded and thrown away. An in-memory
``TensorDataset`` (the built-in sets) is indexed once per batch with a tensor of indices (one
gather per tensor, no per-sample collation): as fast as slicing its tensors by hand.

An ``IterableDataset`` shards itself: it reads :func:`shard_info` inside ``__iter__`` (in the
DataLoader's worker, where it runs) and yields only its part. Its workers are started for each
epoch (they are not persistent), so they see that epoch's :class:`ShardInfo`.

With ``workers > 0`` batches are loaded in worker processes, ``prefetch_factor`` batches ahead
per worker, while the trainer's thread computes and waits on the server: loading overlaps the
step's exchange. Samples are ``(input, target)``; a batch is handed on as ``(x, y)`` with ``x``
a tensor, a tuple or a dict of tensors (``psserver.models.calling``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Sampler, TensorDataset

from psserver.errors import DataError
from psserver.utils.user_code import ExitCalled, running_user_code, timeout_s

log = logging.getLogger(__name__)

PREFETCH_BATCHES = 2
"""Batches each worker loads ahead (the DataLoader's ``prefetch_factor``)."""
INDEX_BYTES_PER_SAMPLE = 64
"""Memory one sample's index takes while an epoch's order is made (``DistributedSampler``'s
``randperm(n).tolist()``, its shard's slice and this module's copy of it): measured 48 bytes for
the first two in CPython 3.11."""


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """What an ``IterableDataset`` is handed to shard itself (:func:`shard_info`).

    Yield the samples ``i`` of the epoch's stream with ``i % num_shards == shard`` (or any
    split of the stream into ``num_shards`` disjoint parts), and skip the first ``skip`` of
    them, which this trainer already trained on before it rejoined.
    """

    rank: int = 0
    """This trainer's data shard (``--rank``); 0 while evaluating (every trainer evaluates all)."""
    num_replicas: int = 1
    """Trainers sharing the data (``--num-trainers``); 1 while evaluating."""
    worker: int = 0
    """The DataLoader worker running this ``__iter__`` (0 without workers)."""
    num_workers: int = 1
    """DataLoader workers of this trainer (1 without workers: the trainer's own process)."""
    epoch: int = 0
    """The epoch being read (0-based), for a shuffle that changes each epoch."""
    seed: int = 0
    """``--data-seed``: the same on every trainer, so shuffles agree."""
    skip: int = 0
    """Samples of this part of the stream already trained on in this epoch (a trainer that
    rejoined mid-epoch): skip them to continue where it was (the rest of the epoch's samples;
    with several workers the order of their batches may differ); 0 otherwise."""

    @property
    def shard(self) -> int:
        """This (trainer, worker) pair's part of the stream: ``rank * num_workers + worker``."""
        return self.rank * self.num_workers + self.worker

    @property
    def num_shards(self) -> int:
        """Parts the stream is split into: ``num_replicas * num_workers``."""
        return self.num_replicas * self.num_workers


@dataclasses.dataclass(frozen=True)
class _Reading:
    """What :func:`shard_info` derives its answer from: set in the trainer before an epoch is
    read and in every worker as it starts (``worker_init_fn``), whatever the start method."""

    rank: int
    num_replicas: int
    epoch: int
    seed: int
    batch_size: int
    done_batches: int


_reading: _Reading | None = None


def shard_info() -> ShardInfo:
    """This reader's shard: call it in an ``IterableDataset``'s ``__iter__``. Outside a
    psserver trainer (a local loop, a test) it is the whole stream, ``ShardInfo()`` with only
    the DataLoader worker filled in, so the same dataset runs anywhere."""
    worker = torch.utils.data.get_worker_info()
    w, n = (worker.id, worker.num_workers) if worker is not None else (0, 1)
    r = _reading
    if r is None:
        return ShardInfo(worker=w, num_workers=n)
    # The DataLoader takes batches from its workers in turn: batch b is worker (b % n)'s.
    done = max(0, math.ceil((r.done_batches - w) / n))
    return ShardInfo(rank=r.rank, num_replicas=r.num_replicas, worker=w, num_workers=n, epoch=r.epoch, seed=r.seed,
                     skip=done * r.batch_size)


def _start_worker(reading: _Reading, worker_id: int) -> None:  # noqa: ARG001 - DataLoader's signature
    global _reading
    _reading = reading


def is_tensor_dataset(dataset: Dataset) -> bool:
    """An in-memory ``TensorDataset`` whose indexing is torch's: indexed with a whole batch at once."""
    return isinstance(dataset, TensorDataset) and type(dataset).__getitem__ is TensorDataset.__getitem__


class _EpochBatches(Sampler):
    """One epoch's batches of indices of this trainer's shard, from ``start`` on (a batch
    sampler; the DataLoader asks it anew for each epoch, after :meth:`set_epoch`)."""

    def __init__(self, sampler: DistributedSampler, batch_size: int, as_tensor: bool) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.as_tensor = as_tensor
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.start = start

    def __len__(self) -> int:
        return max(0, -(-len(self.sampler) // self.batch_size) - self.start)

    def __iter__(self) -> Iterator[Any]:
        indices = list(self.sampler)[self.start * self.batch_size:]
        if self.as_tensor:
            flat = torch.tensor(indices, dtype=torch.long)
            yield from flat.split(self.batch_size)
            return
        for i in range(0, len(indices), self.batch_size):
            yield indices[i:i + self.batch_size]


class Batches:
    """``(x, y)`` batches of one dataset for one reader: a trainer's shard (``shuffle``) or a
    whole held-out set in order (``num_replicas=1``, no shuffle)."""

    def __init__(self, dataset: Dataset, *, name: str, batch_size: int, rank: int = 0, num_replicas: int = 1,
                 shuffle: bool = True, seed: int = 0, workers: int = 0, pin_memory: bool = False) -> None:
        self.dataset = dataset
        self.name = name
        self.batch_size = batch_size
        self.rank, self.num_replicas, self.seed = rank, num_replicas, seed
        self.iterable = isinstance(dataset, IterableDataset)
        self.tensors = is_tensor_dataset(dataset)
        self._iterator: Iterator[Any] | None = None
        common: dict[str, Any] = {
            "num_workers": workers,
            "pin_memory": pin_memory,
            # Workers are seeded from this, not from torch's global generator (the trainer's
            # dropout draws from that one: reading data must not shift it).
            "generator": torch.Generator().manual_seed(seed),
        }
        if workers > 0:
            common["prefetch_factor"] = PREFETCH_BATCHES
        self._batches: _EpochBatches | None = None
        self.persistent = workers > 0 and not self.iterable
        if self.iterable:
            self._reading = _Reading(rank, num_replicas, 0, seed, batch_size, 0)
            common["worker_init_fn"] = functools.partial(_start_worker, self._reading)
            self.loader = DataLoader(dataset, batch_size=batch_size, **common)
            return
        if not isinstance(dataset, Sized) or len(dataset) == 0:
            raise DataError(f"dataset {name} is empty" if isinstance(dataset, Sized) else
                            f"dataset {name} is a map-style Dataset without __len__ (define it, or make it an "
                            "IterableDataset)")
        check_size(len(dataset), name)
        sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                                     drop_last=False)
        self._batches = _EpochBatches(sampler, batch_size, as_tensor=self.tensors)
        if self.persistent:
            common["persistent_workers"] = True  # the sampler runs here: workers need no epoch
        if self.tensors:
            # One index per batch (a tensor of indices): TensorDataset gathers the batch at once.
            self.loader = DataLoader(dataset, sampler=self._batches, batch_size=None, **common)
        else:
            self.loader = DataLoader(dataset, batch_sampler=self._batches, **common)

    @property
    def samples_per_epoch(self) -> int | None:
        """Samples of this reader's shard in one epoch (None: an ``IterableDataset``)."""
        return None if self._batches is None else len(self._batches.sampler)

    @property
    def steps_per_epoch(self) -> int | None:
        """Batches in one epoch (None: an ``IterableDataset``, which ends when its stream does)."""
        n = self.samples_per_epoch
        return None if n is None else -(-n // self.batch_size)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[Any, Any]]:
        """The ``(x, y)`` batches of ``epoch`` from batch ``start`` on (the earlier ones are
        skipped by the sampler, not loaded)."""
        global _reading
        if self._batches is not None:
            self._batches.set_epoch(epoch, start)
        else:
            self._reading = dataclasses.replace(self._reading, epoch=epoch, done_batches=start)
            _reading = self._reading
            self.loader.worker_init_fn = functools.partial(_start_worker, self._reading)
        self._stop_epoch()  # persistent workers are reset by iter(), the others end here
        self._iterator = iter(self.loader)
        index = start
        while True:
            try:
                batch = next(self._iterator)
            except StopIteration:
                return
            except DataError:
                raise
            except Exception as e:  # noqa: BLE001 - the user's data failed: one line, which batch
                log.debug("reading batch %d of %s failed", index, self.name, exc_info=True)
                raise DataError(f"dataset {self.name}: reading batch {index} of epoch {epoch} failed: "
                                f"{_last_line(e)}") from None
            yield self.pair(batch, index)
            index += 1

    def pair(self, batch: Any, index: int = 0) -> tuple[Any, Any]:
        """A loaded batch as ``(x, y)``: a ``TensorDataset``'s tensors are the input's (one, or
        several: a tuple) and the target (the last); a collated ``(input, target)`` pair is
        taken as it is (the list the collation makes of a tuple becomes a tuple again)."""
        if self.tensors:
            *xs, y = batch
            return (xs[0] if len(xs) == 1 else tuple(xs)), y
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise DataError(f"dataset {self.name}: batch {index} is a {_kind(batch)}, not an (input, target) pair "
                            "(samples must be (input, target))")
        x, y = batch
        return (tuple(x) if isinstance(x, list) else x), y

    def close(self) -> None:
        """Stop the worker processes, if any (at the end, and before a trainer re-executes
        itself to rejoin: its workers would outlive the old image)."""
        self._stop_epoch()
        persistent = getattr(self.loader, "_iterator", None)
        if persistent is not None:
            _shutdown(persistent)
            self.loader._iterator = None

    def _stop_epoch(self) -> None:
        it, self._iterator = self._iterator, None
        if it is not None and not self.persistent:
            _shutdown(it)


def _shutdown(iterator: Any) -> None:
    """End a DataLoader iterator's workers now, not when it is collected."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def check_samples(dataset: Dataset, name: str) -> None:
    """``DataError`` unless ``dataset`` is not empty and its first sample is an ``(input,
    target)`` pair whose input is a tensor, a tuple or a dict of tensors (an
    ``IterableDataset`` is checked on its first batch instead: reading it here would start
    its stream)."""
    if isinstance(dataset, IterableDataset):
        return
    if is_tensor_dataset(dataset):
        tensors = dataset.tensors  # type: ignore[attr-defined]
        if len(tensors) < 2:
            raise DataError(f"dataset {name} is a TensorDataset of {len(tensors)} tensor(s): it needs the inputs "
                            "and the targets (the last tensor)")
        if len(dataset) == 0:
            raise DataError(f"dataset {name} is empty")
        return
    if not isinstance(dataset, Sized):
        raise DataError(f"dataset {name} is a map-style Dataset without __len__ (define it, or make it an "
                        "IterableDataset)")
    try:
        size = len(dataset)
    except Exception as e:  # noqa: BLE001 - the user's __len__ failed, or gave no count (-5, 2.5): one line
        log.debug("len() of %s failed", name, exc_info=True)
        raise DataError(f"dataset {name}: its __len__ gives no number of samples ({_last_line(e)})") from None
    if size == 0:
        raise DataError(f"dataset {name} is empty")
    check_size(size, name)
    limit = timeout_s()
    try:
        with running_user_code(f"dataset {name}: reading sample 0", limit):
            sample = dataset[0]
    except (Exception, ExitCalled) as e:  # noqa: BLE001 - the user's dataset failed: one line
        log.debug("reading sample 0 of %s failed", name, exc_info=True)
        raise DataError(f"dataset {name}: reading sample 0 failed: {_last_line(e)}") from None
    check_sample(sample, name)


def check_size(size: int, name: str) -> None:
    """``DataError`` for a map-style dataset whose ``__len__`` claims more samples than this host
    could hold the indices of (an epoch's order is a list of them all): one line now, not a
    ``MemoryError`` or an out-of-memory kill when the first epoch starts."""
    need = size * INDEX_BYTES_PER_SAMPLE
    available = psutil.virtual_memory().available
    if need > available:
        raise DataError(f"dataset {name} has {size:.3g} samples by its __len__: an epoch's order of them would take "
                        f"{need / 2**30:.3g} GiB, more than the {available / 2**30:.3g} GiB this host has available "
                        "(an IterableDataset streams them instead)")


def check_sample(sample: Any, name: str) -> None:
    """``DataError`` unless ``sample`` is ``(input, target)``, its input a tensor (or an array
    or number the collation makes one), a tuple or a dict of them."""
    if not isinstance(sample, tuple | list) or len(sample) != 2:
        raise DataError(f"dataset {name}: sample 0 is a {_kind(sample)}, not an (input, target) pair")
    x = sample[0]
    parts = list(x.values()) if isinstance(x, Mapping) else list(x) if isinstance(x, tuple | list) else [x]
    if not parts or not all(_is_array(p) for p in parts):
        raise DataError(f"dataset {name}: the input of sample 0 is a {_kind(x)}; it must be a tensor, or a tuple or "
                        "dict of tensors")


def check_batch(x: Any, y: Any, name: str) -> None:
    """``DataError`` unless a loaded batch's input is a tensor, a tuple or a dict of tensors
    and its target a tensor (a trainer checks its first batch: an ``IterableDataset``'s first
    sample is only seen there)."""
    parts = list(x.values()) if isinstance(x, Mapping) else list(x) if isinstance(x, tuple | list) else [x]
    if not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        raise DataError(f"dataset {name}: a batch's input is a {_kind(x)}; samples must be (input, target) with the "
                        "input a tensor, or a tuple or dict of tensors")
    if not isinstance(y, torch.Tensor):
        raise DataError(f"dataset {name}: a batch's target is a {_kind(y)}, not a tensor")


def _is_array(value: Any) -> bool:
    return isinstance(value, torch.Tensor | int | float) or type(value).__module__ == "numpy"


def _kind(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def _last_line(e: BaseException) -> str:
    """The useful line of an exception, also one a DataLoader worker re-raised with its
    traceback in the message (the original exception is the last line)."""
    if isinstance(e, ExitCalled):
        return str(e)
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if len(lines) > 1 and "Traceback" in str(e):
        return lines[-1]
    return f"{type(e).__name__}: {lines[0]}"


__all__ = ["INDEX_BYTES_PER_SAMPLE", "PREFETCH_BATCHES", "Batches", "ShardInfo", "check_batch", "check_sample",
           "check_samples", "check_size", "is_tensor_dataset", "shard_info"]
