"""The server half of a step protocol: how one training step is served, one instance per server.

A step protocol says how one training step crosses between a trainer and the server; its two
halves are modules of the same name, the trainer's in ``psserver.trainer.steps`` and the
server's here, each registered by name (Lightning's strategies; ps-lite's swappable request
handler behind a fixed transport). The transport is fixed: the server's endpoint
(``psserver.server.endpoint``) checks membership and dispatches a trainer's call to the
server half's ``ops``, and the server half does its tensor work through the
:class:`~psserver.server.engine.engine.StepEngine`. This module never imports a protocol:
``psserver.server.steps`` imports every module of the package, which registers it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from psserver.common.messages import JoinRequest

if TYPE_CHECKING:
    from psserver.server.engine.engine import StepEngine


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

    def check_join(self, request: JoinRequest) -> None:
        """``ValueError`` for a join this half would refuse, checked before the server changes
        anything for it (a first trainer's model is taken only once nothing can refuse it)."""

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


HALVES: dict[str, type[ServerHalf]] = {}
"""The server half of each step protocol, by its ``--step`` name."""


def register(name: str, half: type[ServerHalf]) -> type[ServerHalf]:
    if name in HALVES:
        raise ValueError(f"step protocol {name!r} is registered twice")
    unknown = [op for op in half.ops + half.local_ops if not callable(getattr(half, op, None))]
    if unknown:
        raise TypeError(f"step protocol {name!r} names ops it does not define: {', '.join(unknown)}")
    HALVES[name] = half
    return half


def server_half(name: str) -> type[ServerHalf]:
    try:
        return HALVES[name]
    except KeyError:
        raise ValueError(f"unknown step protocol {name!r}; known: {', '.join(sorted(HALVES))}") from None
