"""``psserver train``'s way to step: :class:`ModelSteps`, what ``ps.join()`` returns. The step
protocol of any ``--step`` runs a whole step on one batch (forward, loss, backward and the
update: on the trainer, or on the server) and the loop around it only hands batches in
(``psserver.trainer.loop``). Everything that loop needs of the joined model (its spec, loss,
device, where it computes, the trainer's report) is a documented member here, so the loop is a
client of the library like any other.

Its calls go through the connection (``psserver.trainer.connection``), which keeps the
membership: a failed call recovered (``_call``), each step counted in its position
(``_count_step``). :meth:`Connection.train_step` is this object's :meth:`ModelSteps.train_step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from psserver.errors import Evicted
from psserver.models import ModelSpec
from psserver.trainer.membership import Membership
from psserver.trainer.recovery import FAILED, diagnose

if TYPE_CHECKING:
    from psserver.trainer.session import Session


class ModelSteps:
    """The joined model, stepped a batch at a time by its step protocol (``psserver train``'s
    loop; a ``--entry`` loop may use it too): :meth:`train_step`."""

    def __init__(self, ps: Membership, session: Session) -> None:
        self._ps = ps
        self._session = session

    def train_step(self, x: Any, y: Any, *, samples: int,
                   on_failure: Callable[[Exception], None] | None = None) -> float:
        """``psserver train``'s step, for any ``--step``: the step protocol runs forward, the
        loss and backward on ``(x, y)`` (on the trainer, or on the server) and hands the update
        in; the batch's loss. ``on_failure`` sees a failed step's exception first (the first
        step's: data that does not fit the model is the user's error, not a lost server)."""
        session = self._session
        loss = self._ps._call(lambda: session.protocol.step(x, y), on_failure)
        self._ps._count_step(samples, loss)
        after = getattr(session.protocol, "after_step", None)  # every TrainerHalf has one; a stand-in may not
        if after is not None:
            self._ps._call(after)
        return loss

    # ---- the joined model -----------------------------------------------------------------

    @property
    def spec(self) -> ModelSpec:
        """The model the join agreed on: name, input shape and dtype, classes, loss, metric."""
        return self._session.spec

    @property
    def model(self) -> nn.Module | None:
        """The model built in this trainer (None when only the server runs it: ``--step plain``
        of a trainer that builds none of its code)."""
        return self._session.model

    @property
    def loss_fn(self) -> Callable:
        """The training loss: ``--loss``, else the model's own."""
        return self._session.loss_fn

    @property
    def device(self) -> torch.device:
        """The trainer's device (``--device``)."""
        return self._session.device

    @property
    def compute(self) -> str | None:
        """Where a step computes, as the server answered the join: ``trainer`` or ``server``."""
        return self._session.info.get("compute")

    @property
    def row_payload_bytes(self) -> int | None:
        """Bytes of embedding rows and their gradients this trainer's steps carried (None: a
        step protocol without rows)."""
        return getattr(self._session.protocol, "row_payload", None)

    @property
    def transport(self) -> dict[str, str | None] | None:
        """The path this trainer's flat buffers took (``kind``: ``device-map``, ``staged`` or
        ``cpu``) and why a device map it was given failed its probe (``fell_back``; None: it did
        not); None for a protocol without a replica (server compute)."""
        half = self._session.protocol
        kind = getattr(half, "transport", None)
        return None if kind is None else {"kind": kind, "fell_back": getattr(half, "fell_back", None)}

    def host_trainers(self) -> int:
        """Live trainers on this host, this one included, as the server knows them (an RPC
        error, or ``TimeoutError``, when the server does not answer)."""
        return self._session.host_trainers()

    # ---- the membership, as the loop needs it ---------------------------------------------

    def lost_or_evicted(self, error: BaseException) -> bool:
        """Whether a failed call was the membership's end, as the server says (this trainer
        evicted, or the server lost: a step recovers from either), not a failure of the call."""
        return diagnose(self._session, error) != FAILED

    def report_accuracy(self, score: float) -> None:
        """Hand ``score`` (the held-out accuracy) in with this trainer's report: ``psserver
        status`` shows it once the trainer left."""
        report = self._session.report
        if report is not None:
            self._session.report = dataclasses.replace(report, accuracy=score)

    def check_not_evicted(self) -> None:
        """:class:`~psserver.errors.Evicted` (exit 3, one line with the server's reason) when the
        server evicted this trainer along with one of its last steps: no later call failed on
        it, and the run would otherwise end as a success (exit 0, a metric of a model it no
        longer trains). The membership is abandoned first: there is nothing to leave."""
        session = self._session
        if session.evicted is None:
            return
        name = session.name
        session.abandon()
        config = self._ps.config
        raise Evicted(f"{name} was evicted by the psserver at {config.server_host}:{config.server_port} "
                      f"with its last steps: {session.evicted}")

    def __repr__(self) -> str:
        return f"<psserver ModelSteps {self._session.spec.name} ({self._session.step_protocol})>"
