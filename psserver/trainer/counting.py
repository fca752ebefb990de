"""How many samples a step of a user's own loop trained on, when ``ps.step()`` is not told:
what a rejoined trainer's sampler skips of the epoch it was in (``psserver.trainer.sampler``)."""

from __future__ import annotations

import operator

import torch
from torch import nn

from psserver.errors import UsageError
from psserver.models.calling import input_batch_size


class SampleCounter:
    """The replica's forward pre-hook that counts a step's samples: the batch size (dim 0 of
    its first input) of the step's first forward with grad enabled in training mode, else of
    its first forward with grad enabled (a loop that fine-tunes in ``eval()`` mode, frozen
    BatchNorm), else 0. One forward per backward pass, not their sum: a siamese loop runs two
    on one batch, a forward under ``no_grad`` (validation) trains nothing, and K backward passes
    before one ``ps.step()`` (accumulation) are K micro-batches: the replica's parameters call
    :meth:`passed` as their gradients accumulate.

    A plain object of module level, holding neither the connection nor a lock, because the
    hook travels with the model: ``copy.deepcopy``, ``AveragedModel`` and ``torch.save`` of
    the whole replica copy or pickle it (a copy counts into its own counter, unread)."""

    def __init__(self) -> None:
        self.training: int | None = None
        self.grad: int | None = None
        self.banked = 0

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or self.training is not None:
            return
        if not module.training and self.grad is not None:
            return
        x = args[0] if len(args) == 1 else (args if args else kwargs)
        try:
            n = input_batch_size(x)
        except (TypeError, ValueError, IndexError):
            return  # an input whose batch size cannot be read: pass samples= to step()
        if module.training:
            self.training = n
        if self.grad is None:
            self.grad = n

    def _current(self) -> int:
        n = self.training if self.training is not None else self.grad if self.grad is not None else 0
        self.training = self.grad = None
        return n

    def passed(self, _param: object = None) -> None:
        """A backward pass reached a parameter (each one calls it; the first of a pass banks):
        the forwards before it were its micro-batch, and the next forward counts anew."""
        self.banked += self._current()

    def take(self) -> int:
        """The step's samples, counting anew from here."""
        n, self.banked = self.banked + self._current(), 0
        return n


def sample_count(samples: object) -> int:
    """``ps.step(samples=...)`` as an int >= 0: checked here, since the server would refuse it
    with a remote traceback (an int tensor or a NumPy int is taken)."""
    try:
        if isinstance(samples, bool):
            raise TypeError
        n = operator.index(samples)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        raise UsageError(f"ps.step: samples must be an int >= 0 (the step's batch size), got {samples!r}") from None
    if n < 0:
        raise UsageError(f"ps.step: samples must be an int >= 0 (the step's batch size), got {n}")
    return n
