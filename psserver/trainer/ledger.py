"""Where a trainer is in its run, kept by its connection whichever way it steps: each step
counted into its :class:`~psserver.trainer.rejoin.Position` (epoch, steps, samples, loss) and
the report the heartbeat carries, a failed step's count rolled back to be made again, and the
samples of the epoch that ``ps.sampler``'s samplers skip after a rejoin or a restart."""

from __future__ import annotations

import logging
import time

import torch
from torch.utils.data import Dataset

from psserver.common.messages import Report
from psserver.trainer.rejoin import Position
from psserver.trainer.sampler import ResumableSampler
from psserver.utils.divergence import GrowthWatch

log = logging.getLogger(__name__)


class Ledger:
    """A connection's position (:attr:`pos`), the samplers it made, and what they skip."""

    def __init__(self, resumed: Position | None) -> None:
        self.pos = resumed or Position()
        self._resume: tuple[int, int] | None = (self.pos.epoch, self.pos.epoch_samples) if resumed else None
        """``(epoch, samples)`` a sampler skips once: what the epoch trained before a rejoin or a restart."""
        self._samplers: list[ResumableSampler] = []
        self._warned_count = False
        self._losses = GrowthWatch()  # a loss gone far off while finite is told once

    def continue_from(self, at: dict[str, int], rank: int) -> None:
        """Take up the position of this rank's last trainer, which left the job unfinished."""
        pos = self.pos
        pos.epoch, pos.epoch_samples, pos.batch_idx = at["epoch"], at["epoch_samples"], at["batch_idx"]
        pos.steps, pos.samples = at["steps"], at["samples"]
        pos.samples_before = pos.samples
        self._resume = (pos.epoch, pos.epoch_samples)
        log.warning("rank %d continues where its last trainer stopped: epoch %d, %d of its samples in it, step %d "
                    "(psserver train --start-over, or TrainerConfig(start_over=True), starts over)", rank,
                    pos.epoch, pos.epoch_samples, pos.steps)

    def sampler(self, dataset: Dataset, *, num_replicas: int, rank: int, shuffle: bool, seed: int,
                drop_last: bool) -> ResumableSampler:
        """A sampler of this rank's shard that resumes the epoch where the position is."""
        sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                                   drop_last=drop_last, on_epoch=self._on_epoch, skip=self._skip,
                                   epoch=self.pos.epoch)
        self._samplers.append(sampler)
        return sampler

    def _skip(self, epoch: int, take: bool) -> int:
        """How many samples of ``epoch`` the first sampler to go through it skips (those trained
        on before a rejoin or a restart): taken once, by one sampler (a held-out sampler made
        with ``ps.sampler`` too goes through its epoch whole)."""
        pending = self._resume
        if pending is None or pending[0] != epoch:
            return 0
        if take:
            self._resume = None
        return pending[1]

    def _on_epoch(self, epoch: int) -> None:
        if epoch != self.pos.epoch:
            self.pos.epoch = epoch
            self.pos.epoch_samples = 0

    def count(self, samples: int, loss: float | torch.Tensor | None, steps_per_epoch: int | None) -> Report:
        """A step done, of ``samples``: the report the server is told from now on."""
        pos = self.pos
        pos.steps += 1
        pos.samples += samples
        pos.epoch_samples += samples
        if loss is not None:
            pos.loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            diverging = self._losses.observe(pos.loss)
            if diverging:
                log.warning("loss %s", diverging)
        rate = (pos.samples - pos.samples_before) / max(1e-6, time.monotonic() - pos.t_start)
        # psserver train's loop counts the batch after the step: the report says where the next starts.
        batches = pos.batch_idx + 1 if steps_per_epoch is not None else pos.batch_idx
        return Report(pos.steps, pos.samples, pos.loss, rate, epoch=pos.epoch, epoch_samples=pos.epoch_samples,
                      batch_idx=batches)

    def roll_back(self, samples: int, steps_per_epoch: int | None) -> None:
        """A failed call did not hand in the gradient of the last step counted (of ``samples``):
        that step is made again after the rejoin, under the same number, so the server applies
        it once, whether the process that died had applied it or not."""
        pos = self.pos
        if pos.epoch_samples >= samples:
            pos.epoch_samples -= samples
            pos.batch_idx = max(0, pos.batch_idx - 1)
        elif pos.epoch > 0 and steps_per_epoch:  # the last step of the epoch before
            pos.epoch -= 1
            pos.batch_idx = steps_per_epoch - 1
            pos.epoch_samples = 0  # (psserver train's loop, the one that sets steps_per_epoch, resumes by batch_idx)
        else:
            log.warning("the gradient of step %d was not handed in and cannot be made again (it ended an epoch of "
                        "unknown length): it is lost", pos.steps)
            return
        pos.steps -= 1
        pos.samples -= samples

    def check_count(self) -> None:
        """Warn (once) when the samples counted in this epoch exceed what this connection's
        samplers handed out in it: the counter read a dimension that is not the batch's."""
        if self._warned_count or not self._samplers:
            return
        pos = self.pos
        handed = sum(s.handed_out(pos.epoch) for s in self._samplers)
        if pos.epoch_samples > handed:
            self._warned_count = True
            log.warning("ps.step counted %d samples in epoch %d, more than ps.sampler has handed out (%d): the count "
                        "reads dim 0 of the model's first input, which is not the batch's here (a sequence model fed "
                        "(T, B, ...) counts T); pass ps.step(samples=...)", pos.epoch_samples, pos.epoch, handed)
