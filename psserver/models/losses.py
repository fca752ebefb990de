"""Training losses by name: a model's spec names its loss (``ModelSpec.loss``), so the trainers
need no per-model code and a spec with a typo fails when it is registered."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import Tensor
from torch.nn import functional as F

log = logging.getLogger(__name__)


def cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Classification: ``[n, classes]`` logits against ``[n]`` class indices."""
    return F.cross_entropy(outputs, targets)


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    """Regression (ratings): one output per float target, in float32 whatever the autocast."""
    targets = targets.float()
    return F.mse_loss(outputs.float().reshape(targets.shape), targets)


def bce(outputs: Tensor, targets: Tensor) -> Tensor:
    """Clicks: one logit per 0/1 float target (``binary_cross_entropy_with_logits``, which is
    stable where a sigmoid followed by a log is not)."""
    targets = targets.float()
    return F.binary_cross_entropy_with_logits(outputs.float().reshape(targets.shape), targets)


LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "cross_entropy": cross_entropy,
    "mse": mse,
    "bce": bce,
}


def get_loss(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The loss called ``name``, or ``ValueError`` listing the known ones."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; known: {', '.join(sorted(LOSSES))}") from None


__all__ = ["LOSSES", "bce", "cross_entropy", "get_loss", "mse"]
