"""Held-out metrics by name: a model's spec names the one a trainer reports at the end
(``ModelSpec.metric``), so the trainers need no per-model code.

Each metric takes the model's outputs and the targets of a whole evaluation set and returns a
float. (Not ``psserver.metrics``: that is the Prometheus endpoint.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def accuracy(outputs: Tensor, targets: Tensor) -> float:
    """Fraction of samples whose highest-scoring class (``argmax`` over dim 1) is the target."""
    if outputs.dim() != 2 or outputs.shape[0] != targets.reshape(-1).shape[0]:
        raise ValueError(f"accuracy needs [n, classes] outputs for n targets, got {tuple(outputs.shape)} "
                         f"and {tuple(targets.shape)}")
    if not targets.numel():
        return float("nan")
    return float((outputs.argmax(1) == targets.reshape(-1)).double().mean())


def rmse(outputs: Tensor, targets: Tensor) -> float:
    """Root mean squared error (in float64, so large evaluation sets do not lose precision)."""
    outputs, targets = outputs.double().reshape(-1), targets.double().reshape(-1)
    if outputs.shape != targets.shape:
        raise ValueError(f"rmse needs one output per target, got {outputs.numel()} and {targets.numel()}")
    if not targets.numel():
        return float("nan")
    return float((outputs - targets).pow(2).mean().sqrt())


def auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (the Mann-Whitney statistic, ties counted half)."""
    scores, labels = scores.double().reshape(-1), labels.reshape(-1) > 0.5
    pos, neg = int(labels.sum()), int((~labels).sum())
    if not pos or not neg:
        raise ValueError("AUC needs both positive and negative samples")
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    sorted_scores = scores[order]
    # Average ranks over ties.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


METRICS: dict[str, Callable[[Tensor, Tensor], float]] = {
    "accuracy": accuracy,
    "rmse": rmse,
    "auc": auc,
}


def get_metric(name: str) -> Callable[[Tensor, Tensor], float]:
    """The metric called ``name``, or ``ValueError`` listing the known ones."""
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; known: {', '.join(sorted(METRICS))}") from None


__all__ = ["METRICS", "accuracy", "auc", "get_metric", "rmse"]
