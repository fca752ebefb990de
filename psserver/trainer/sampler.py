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
                 resume: tuple[int, int] | None = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._on_epoch = on_epoch
        self._resume = resume
        """``(epoch, samples)``: in that epoch, the first ``samples`` of this shard were trained on."""
        if resume is not None:
            self.epoch = resume[0]
        self._handed = (self.epoch, 0)
        """``(epoch, n)``: the indices handed out in that epoch (the resumed ones included)."""

    def resume_at(self, epoch: int, samples: int) -> None:
        """Skip, in ``epoch``, the first ``samples`` of this shard (a trainer that continues
        where its rank's last one stopped, learnt at the join after this sampler was made)."""
        self._resume = (epoch, samples)
        self.epoch = epoch
        self._handed = (epoch, 0)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if self._on_epoch is not None:
            self._on_epoch(epoch)

    def _skip(self) -> int:
        if self._resume is None or self._resume[0] != self.epoch:
            return 0
        return self._resume[1]

    def handed_out(self, epoch: int) -> int:
        """How many indices this sampler has handed out in ``epoch`` (those a resumed epoch
        skips counted as handed out before): the bound of what a loop trained in it."""
        return self._handed[1] if self._handed[0] == epoch else 0

    def __iter__(self) -> Iterator[int]:
        skip = self._skip()
        self._resume = None  # once: the epoch after it, and a second pass over it, are whole
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
