"""Held-out metrics by name: a model's spec names the one a trainer reports at the end
(``ModelSpec.metric``), so the trainers need no per-model code.

Each metric takes the model's outputs and the targets of a whole evaluation set and returns a
float. ``--metric`` may also name ``loss`` (the mean held-out loss under the training loss) or a
user's ``MODULE:ATTR`` (:func:`resolve_metric`). (Not ``psserver.exporters``: that is the
Prometheus endpoint.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from psserver.errors import DataError, UsageError, UserCodeError
from psserver.utils.references import call_user, is_reference, load_reference

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
    if scores.shape != labels.shape:
        raise ValueError(f"auc needs one score per label, got {scores.numel()} and {labels.numel()} (a model of "
                         "one output, a click's logit or probability)")
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


LOSS_METRIC = "loss"
"""``--metric loss``: the mean held-out loss under the training loss (a language model's)."""


def metric_names() -> list[str]:
    """What ``--metric`` takes besides ``MODULE:ATTR``."""
    return [*sorted(METRICS), LOSS_METRIC]


Metric = Callable[[Tensor, Tensor], float]


def resolve_metric(reference: str | None, default: str,
                   loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None) -> tuple[str, Metric]:
    """The name a trainer prints and the function of ``--metric`` (None: ``default``, the
    model spec's): a name of :data:`METRICS`; ``loss``, the mean of ``loss_fn`` over the
    held-out set (its outputs concatenated: a loss that averages over samples); or
    ``MODULE:ATTR``, a callable ``(outputs, targets) -> float`` named by its attribute. A
    user's metric runs through :func:`call_user`, so its failure is one line too. Without
    ``loss_fn`` (at configuration time) ``loss`` is only checked as a name."""
    name = default if reference is None else reference.strip()
    if name == LOSS_METRIC:
        return LOSS_METRIC, _mean_loss(loss_fn)
    if not is_reference(name):
        if name not in METRICS:
            raise UserCodeError(f"unknown metric {name!r}; known: {', '.join(metric_names())} (or MODULE:ATTR, a "
                                "callable (outputs, targets) -> float)")
        return name, METRICS[name]
    fn = load_reference(name, "--metric")
    if isinstance(fn, type) or not callable(fn):
        raise UserCodeError(f"--metric {name} is a {'class' if isinstance(fn, type) else type(fn).__name__}, not a "
                            "callable (outputs, targets) -> float")
    short = name.rpartition(":")[2].rpartition(".")[2]

    def user_metric(outputs: Tensor, targets: Tensor) -> float:
        value = call_user(fn, (outputs, targets), {}, f"--metric {name}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UserCodeError(f"--metric {name} returned a {type(value).__name__}, not a number") from None

    return short, user_metric


def _mean_loss(loss_fn: Callable[[Tensor, Tensor], Tensor] | None) -> Callable[[Tensor, Tensor], float]:
    def mean_loss(outputs: Tensor, targets: Tensor) -> float:
        if loss_fn is None:
            raise ValueError("--metric loss needs the training loss")
        if not targets.numel():
            return float("nan")
        with torch.no_grad():
            return float(loss_fn(outputs, targets))

    return mean_loss


def check_outputs(fn: Callable, outputs: object) -> None:
    """A built-in metric (accuracy, rmse, auc) reads one tensor of outputs: a model that returns a
    tuple or dict (Hugging Face style) is the user's to score, so say how, in one line."""
    name = next((n for n, f in METRICS.items() if f is fn), None)
    if name is not None and not isinstance(outputs, Tensor):
        raise UsageError(f"metric {name} needs the model's outputs as one tensor, and the model returns a "
                         f"{type(outputs).__name__}: pass a metric callable (outputs, targets) -> float "
                         "(psserver train --metric MODULE:ATTR, ps.evaluate(metric=...))")


def concat_outputs(parts: list[Any]) -> Any:
    """The outputs of several batches as one, in the structure the model returns them: tensors
    along dim 0 (0-dim ones, such as a loss in an output dict, stacked), tuples and lists member
    by member, dicts key by key; anything else as the list of its batches' values."""
    first = parts[0]
    try:
        if isinstance(first, torch.Tensor):
            return torch.cat(parts) if first.dim() else torch.stack(parts)
        if isinstance(first, Mapping):
            if any(not isinstance(p, Mapping) or p.keys() != first.keys() for p in parts):
                raise ValueError("keys")
            return {k: concat_outputs([p[k] for p in parts]) for k in first}
        if isinstance(first, tuple | list):
            members = [concat_outputs(list(group)) for group in zip(*parts, strict=True)]
            if hasattr(first, "_fields"):  # a namedtuple
                return type(first)(*members)
            return type(first)(members)
    except (TypeError, ValueError, RuntimeError) as e:
        raise DataError(f"the model's outputs differ between held-out batches ({type(first).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}); they cannot be concatenated "
                        "for the metric") from None
    return list(parts)


__all__ = ["LOSS_METRIC", "METRICS", "accuracy", "auc", "check_outputs", "concat_outputs", "get_metric", "metric_names",
           "resolve_metric", "rmse"]

