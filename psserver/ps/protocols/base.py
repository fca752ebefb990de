"""A step protocol: how one training step crosses between a trainer and the server.

Each protocol is one module with a trainer half and a server half, registered by name
(Lightning's strategies; ps-lite's swappable request handler behind a fixed transport). The
transport is fixed: the trainer half reaches the server through its :class:`Channel`
(``psserver.trainer.session.Session``), the server's endpoint (``psserver.ps.server.endpoint``) checks
membership and dispatches to the server half's ``ops``, and the server half does its tensor
work through the :class:`~psserver.ps.engine.engine.StepEngine`. This module never imports a
protocol: ``psserver.ps.protocols`` imports every module of the package, which registers it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from psserver.models import ModelSpec
from psserver.ps.engine.engine import StepEngine
from psserver.ps.rpc.messages import JoinRequest


class Channel(Protocol):
    """What a trainer half sees of its session with the server."""

    name: str
    """This trainer's RPC name."""
    info: dict[str, Any]
    """The server's reply to the join (model, update mode, the server half's ``join_info``)."""

    servers: list[str]
    """RPC names of the server processes, server 0 first (more than one: ``--num-servers``)."""
    spec: ModelSpec
    """The trainer's model (``--model``, else the server's)."""
    model: torch.nn.Module
    """Its replica, as built, its layout the server's (trainer compute runs it)."""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    """The training loss (``--loss``, else the model's), computed on the trainer in every protocol."""
    steps_before: int
    """Steps this rank trained before this join (0: a fresh trainer); its gradients are numbered on from there."""
    bucket_cap_mb: float
    """MiB per gradient bucket filled during backward (``--bucket-cap-mb``, ``psserver.ps.engine.buckets``)."""

    def call(self, op: str, *args: Any) -> Any:
        """Call ``op`` of this protocol's server half (synchronously, one RPC)."""
        ...

    def call_each(self, op: str, args: list[tuple]) -> list[Any]:
        """Call ``op`` on every server process at once, ``args[i]`` for server i."""
        ...

    def call_async(self, op: str, *args: Any) -> Any:
        """Call ``op`` without waiting: a future whose ``wait()`` raises as :meth:`call` would."""
        ...


class TrainerHalf(ABC):
    """The trainer's side of a protocol: one step at a time, on the trainer's thread."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    @abstractmethod
    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Train on one batch; the batch's loss."""

    def flush(self) -> None:
        """Hand in anything still owed to the server (before evaluating or leaving)."""

    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """The model's outputs for ``x`` (default: computed by the server)."""
        return self.channel.call("evaluate", x)

    def close(self) -> None:
        """Release what the half holds of the session (its RPC handles)."""


class ServerHalf:
    """The server's side of a protocol, one instance per server, shared by its trainers.

    ``ops`` are the methods a trainer may call over RPC, each as ``op(trainer, *args)``;
    ``local_ops`` are called in-process on the server (for example by torch's
    ``DistributedOptimizer`` machinery), through the endpoint so they are counted too.
    """

    ops: ClassVar[tuple[str, ...]] = ()
    local_ops: ClassVar[tuple[str, ...]] = ()
    compute_threads: ClassVar[int | None] = None
    """Intra-op threads of its work on the compute thread (None: the server's)."""

    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine

    def join_info(self, trainer: str, request: JoinRequest) -> dict[str, Any]:
        """What the trainer half needs from the server, added to the join reply (``ValueError``
        refuses the join)."""
        return {}

    def evaluate(self, trainer: str, x: torch.Tensor) -> torch.Tensor:
        self.engine.wait_applied(trainer)
        return self.engine.evaluate(x)

    def finish_then_start(self, trainer: str, finish: Callable[[], None],
                          start: Callable[[], Any] | None) -> Any:
        """One-round-trip protocols: ``finish`` the trainer's last step (its update), then
        ``start`` its next one (None: nothing to start), both on the compute thread. One
        hand-off when the next step may start whatever the update does (async always; ssp while
        the trainer is within the staleness bound). Otherwise (sync; ssp at the bound) the
        trainer waits for its turn in between, on this RPC thread, never on the compute thread
        (which applies the updates it waits for)."""
        engine, threads = self.engine, self.compute_threads
        if start is not None and engine.try_start(trainer):
            return engine.compute.run_with(threads, lambda: (finish(), start())[1])
        engine.compute.run_with(threads, finish)
        if start is None:
            return None
        engine.wait_turn(trainer)
        return engine.compute.run_with(threads, start)

    def trainer_gone(self, trainer: str, evicted: bool) -> None:
        """``trainer`` left (``evicted``: died or hung): drop what it holds here."""

    def close(self) -> None:
        """The server is stopping (RPC still up)."""


@dataclass(frozen=True)
class StepProtocol:
    name: str
    trainer: type[TrainerHalf]
    server: type[ServerHalf]


PROTOCOLS: dict[str, StepProtocol] = {}


def register(protocol: StepProtocol) -> StepProtocol:
    if protocol.name in PROTOCOLS:
        raise ValueError(f"step protocol {protocol.name!r} is registered twice")
    unknown = [op for op in protocol.server.ops + protocol.server.local_ops if not callable(
        getattr(protocol.server, op, None))]
    if unknown:
        raise TypeError(f"step protocol {protocol.name!r} names ops it does not define: {', '.join(unknown)}")
    PROTOCOLS[protocol.name] = protocol
    return protocol


def get_protocol(name: str) -> StepProtocol:
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ValueError(f"unknown step protocol {name!r}; known: {', '.join(sorted(PROTOCOLS))}") from None
