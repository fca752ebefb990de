"""What each way to step (``replica``, ``remote_model``, ``model_steps``) uses of its
connection: the :class:`Membership` a :class:`~psserver.trainer.connection.Connection` is. A
protocol, so that those modules name no ``Connection`` (which imports them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from psserver.config import TrainerConfig


class Membership(Protocol):
    """A connection, as the object it steps through sees it."""

    config: TrainerConfig

    def _call(self, fn: Callable[[], Any], on_failure: Callable[[Exception], None] | None = None) -> Any:
        """A call of the step protocol; a failed one diagnosed by asking the server (evicted,
        lost: recovered or ended; a failure of the call itself raised)."""

    def _count_step(self, samples: int, loss: float | torch.Tensor | None) -> None:
        """A step done: the position and the report the server is told."""

    def _check_count(self) -> None:
        """Warn once when the samples counted outrun what the connection's samplers handed out."""

    def leave_on_signal(self) -> None:
        """After SIGTERM or SIGINT: leave, and exit 128 + the signal (the step boundary)."""
