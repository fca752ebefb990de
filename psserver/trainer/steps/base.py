"""The trainer half of a step protocol: one training step at a time, on the trainer's thread.

A step protocol says how one training step crosses between a trainer and the server; its two
halves are modules of the same name, the trainer's here and the server's in
``psserver.server.steps``, each registered by name. The trainer half reaches the server
through its :class:`Channel` (``psserver.trainer.session.Session``), whose calls name the
RPC surface (``psserver.common.calls``) and never the server's code. This module never
imports a protocol: ``psserver.trainer.steps`` imports every module of the package, which
registers it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch

from psserver.config import TrainerConfig
from psserver.models import ModelSpec


class Channel(Protocol):
    """What a trainer half sees of its session with the server."""

    name: str
    """This trainer's RPC name."""
    config: TrainerConfig
    """The trainer's configuration (``--step diloco`` reads its local steps and inner optimizer)."""
    info: dict[str, Any]
    """The server's reply to the join (model, update mode, the server half's ``join_info``)."""

    servers: list[str]
    """RPC names of the server processes, server 0 first (more than one: ``--num-servers``)."""
    spec: ModelSpec
    """The trainer's model (``--model``, else the server's)."""
    model: torch.nn.Module | None
    """Its replica, as built, its layout the server's (trainer compute runs it); None on the RPC
    tutorial's path (``--step plain`` through ``ps.parameter_rrefs``), where the server runs it."""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    """The training loss (``--loss``, else the model's), computed on the trainer in every protocol."""
    steps_before: int
    """Steps this rank trained before this join (0: a fresh trainer); its gradients are numbered on from there."""
    bucket_cap_mb: float
    """MiB per gradient bucket filled during backward (``--bucket-cap-mb``, ``psserver.trainer.compute.buckets``)."""

    def call(self, op: str, *args: Any) -> Any:
        """Call ``op`` of this protocol's server half (synchronously, one RPC)."""
        ...

    def call_each(self, op: str, args: list[tuple]) -> list[Any]:
        """Call ``op`` on every server process at once, ``args[i]`` for server i."""
        ...

    def call_async(self, op: str, *args: Any) -> Any:
        """Call ``op`` without waiting: a future whose ``wait()`` raises as :meth:`call` would."""
        ...

    def call_each_async(self, op: str, args: list[tuple]) -> Any:
        """:meth:`call_each` without waiting: a future whose ``wait()`` gives the list."""
        ...


class TrainerHalf(ABC):
    """The trainer's side of a protocol: one step at a time, on the trainer's thread."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    @abstractmethod
    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Train on one batch; the batch's loss."""

    def after_step(self) -> None:
        """The calls that hand in what the step just counted made (DiLoCo's sync at a window's
        end): made once the step is in the trainer's position, so that the report they carry
        counts it, and a trainer started again after them does not train its batch again."""

    def flush(self) -> None:
        """Hand in anything still owed to the server (before evaluating or leaving)."""

    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """The model's outputs for ``x`` (default: computed by the server)."""
        return self.channel.call("evaluate", x)

    def close(self) -> None:
        """Release what the half holds of the session (its RPC handles)."""


HALVES: dict[str, type[TrainerHalf]] = {}
"""The trainer half of each step protocol, by its ``--step`` name."""


def register(name: str, half: type[TrainerHalf]) -> type[TrainerHalf]:
    if name in HALVES:
        raise ValueError(f"step protocol {name!r} is registered twice")
    HALVES[name] = half
    return half


def trainer_half(name: str) -> type[TrainerHalf]:
    try:
        return HALVES[name]
    except KeyError:
        raise ValueError(f"unknown step protocol {name!r}; known: {', '.join(sorted(HALVES))}") from None
