"""``ps.sampler(dataset)``: this trainer's shard of a map-style dataset, resumable.

It is torch's ``DistributedSampler`` (rank and number of shards from the connection), plus one
thing a parameter-server trainer needs: after a rejoin (``connect(reconnect=True)`` re-executes
the script) the epoch it was in continues where it stopped, without the samples it already
trained on, so a rejoin neither repeats nor skips data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch.utils.data import Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that tells its connection which epoch runs, and skips, in the
    epoch a rejoined trainer resumes, the samples it trained on before."""

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, on_epoch: Callable[[int], None] | None = None,
                 skip: Callable[[int, bool], int] | None = None, epoch: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.epoch = epoch  # the connection's (ps.epoch): a rejoined trainer's, until set_epoch
        self._on_epoch = on_epoch
        self._skip_of = skip
        """``skip(epoch, take)``: the samples of this shard in ``epoch`` trained on before a rejoin,
        taken (``take``) by the first sampler of the connection to go through that epoch."""
        self._handed = (self.epoch, 0)
        """``(epoch, n)``: the indices handed out in that epoch (the resumed ones included)."""

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if self._on_epoch is not None:
            self._on_epoch(epoch)

    def _skip(self, take: bool = False) -> int:
        return 0 if self._skip_of is None else self._skip_of(self.epoch, take)

    def handed_out(self, epoch: int) -> int:
        """How many indices this sampler has handed out in ``epoch`` (those a resumed epoch
        skips counted as handed out before): the bound of what a loop trained in it."""
        return self._handed[1] if self._handed[0] == epoch else 0

    def __iter__(self) -> Iterator[int]:
        skip = self._skip(take=True)  # once: the epoch after it, a second pass, another sampler: whole
        epoch = self.epoch
        handed = (self._handed[1] if self._handed[0] == epoch else 0) + skip
        self._handed = (epoch, handed)
        it = super().__iter__()
        for _ in range(skip):
            if next(it, None) is None:
                return
        for i in it:
            handed += 1
            self._handed = (epoch, handed)
            yield i

    def __len__(self) -> int:
        return max(0, super().__len__() - self._skip())
