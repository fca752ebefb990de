"""How a model is called on a batch's input, in one place for every step protocol.

A sample is ``(input, target)`` and its input is a tensor, a tuple of tensors or a dict of
tensors, so a batch's input is one of those three too. The model is then called ``model(x)``,
``model(*x)`` or ``model(**x)``: the convention of ``torch.func.functional_call``'s ``args``
and ``kwargs``, and of the DataLoader's default collation, which keeps tuples and dicts of a
sample as they are (a list it makes of a tuple is turned back into one).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

Input = torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]
"""A batch's input: a tensor, a tuple of tensors (``model(*x)``) or a dict (``model(**x)``)."""


def model_arguments(x: Input) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments a model takes ``x`` as (``functional_call``'s
    ``args`` and ``kwargs``)."""
    if isinstance(x, Mapping):
        return (), dict(x)
    if isinstance(x, tuple | list):
        return tuple(x), {}
    return (x,), {}


def call_model(model: nn.Module, x: Input) -> Any:
    """``model(x)``, ``model(*x)`` or ``model(**x)``, by the kind of ``x``."""
    args, kwargs = model_arguments(x)
    return model(*args, **kwargs)


def move_input(x: Input, device: torch.device | str, non_blocking: bool = False) -> Input:
    """``x`` with every tensor on ``device`` (the structure kept; anything else left alone)."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=non_blocking)
    if isinstance(x, Mapping):
        return {k: move_input(v, device, non_blocking) for k, v in x.items()}
    if isinstance(x, tuple | list):
        return tuple(move_input(v, device, non_blocking) for v in x)
    return x


def input_batch_size(x: Input) -> int:
    """Samples in a batch whose input is ``x``: the first dimension of its first tensor."""
    if isinstance(x, torch.Tensor):
        return int(x.shape[0]) if x.dim() else 1
    values = list(x.values()) if isinstance(x, Mapping) else list(x) if isinstance(x, tuple | list) else []
    for v in values:
        if isinstance(v, torch.Tensor | tuple | list | Mapping):
            return input_batch_size(v)
    raise ValueError(f"a batch's input holds no tensor: {type(x).__name__}")


def describe_input(x: Any, per_sample: bool = True) -> str:
    """The shape of ``x`` for a message: ``(1, 28, 28)``, ``((4,), (4, 8))``, ``{ids: (4,)}``;
    ``per_sample``: without the batch dimension."""
    if isinstance(x, torch.Tensor):
        shape = tuple(x.shape[1:] if per_sample and x.dim() else x.shape)
        return str(shape)
    if isinstance(x, Mapping):
        return "{" + ", ".join(f"{k}: {describe_input(v, per_sample)}" for k, v in x.items()) + "}"
    if isinstance(x, tuple | list):
        return "(" + ", ".join(describe_input(v, per_sample) for v in x) + ")"
    return type(x).__name__


__all__ = ["Input", "call_model", "describe_input", "input_batch_size", "model_arguments", "move_input"]
