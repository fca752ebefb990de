"""Training losses by name or reference: a model's spec names its loss (``ModelSpec.loss``), so
the trainers need no per-model code and a spec with a typo fails when it is registered; a user's
``--loss MODULE:ATTR`` replaces it (:func:`resolve_loss`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import Tensor, nn
from torch.nn import functional as F

from psserver.errors import UserCodeError
from psserver.utils.references import call_user, is_reference, load_reference
from psserver.utils.user_code import bound_first_call

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


def next_token_cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Language modelling: ``[n, t, vocab]`` logits against the ``[n, t]`` next tokens, the
    mean over every position (nats a token; / ln 2 is bits a byte for a byte model)."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]).float(), targets.reshape(-1))


LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "cross_entropy": cross_entropy,
    "next_token_cross_entropy": next_token_cross_entropy,
    "mse": mse,
    "bce": bce,
}


def get_loss(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The loss called ``name``, or ``ValueError`` listing the known ones."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; known: {', '.join(sorted(LOSSES))}") from None


def resolve_loss(reference: str | None, default: str = "cross_entropy") -> Callable[[Tensor, Tensor], Tensor]:
    """The training loss of ``--loss`` (None: ``default``, the model spec's): a name of
    :data:`LOSSES`, or ``MODULE:ATTR`` naming a callable ``(output, target) -> scalar`` or an
    ``nn.Module`` class, which is instantiated without arguments (``nn.CrossEntropyLoss``).
    ``ValueError`` of one line (a ``UserCodeError``) for anything else."""
    name = default if reference is None else reference.strip()
    if not is_reference(name):
        if name not in LOSSES:
            raise UserCodeError(f"unknown loss {name!r}; known: {', '.join(sorted(LOSSES))} (or MODULE:ATTR, a "
                                "callable (output, target) -> scalar or an nn.Module class)")
        return LOSSES[name]
    target = load_reference(name, "--loss")
    if isinstance(target, type):
        if not issubclass(target, nn.Module):
            raise UserCodeError(f"--loss {name} is the class {target.__name__}, not an nn.Module class (or a "
                                "function (output, target) -> scalar)")
        target = call_user(target, (), {}, f"--loss {name}")
    if not callable(target):
        raise UserCodeError(f"--loss {name} is a {type(target).__name__}, not a callable (output, target) -> "
                            "scalar or an nn.Module class")
    return bound_first_call(target, f"--loss {name}")


def loss_name(reference: str | None, default: str = "cross_entropy") -> str:
    """What logs call the loss of ``--loss`` (its attribute's name for a reference)."""
    name = default if reference is None else reference.strip()
    return name.rpartition(":")[2].rpartition(".")[2] if is_reference(name) else name


__all__ = ["LOSSES", "bce", "cross_entropy", "get_loss", "loss_name", "mse", "resolve_loss"]
