"""What a loop measures through its connection, whichever way it steps: ``ps.evaluate`` (a
metric of the server's current parameters over held-out data, through the step protocol's
trainer half) and ``ps.allreduce`` (a metric reduced over the job's trainers through the
server, Horovod's ``metric_average``). The connection's methods of those names call these with
its ``_call``, which recovers a failed call."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from psserver.common.messages import ALLREDUCE_MAX_ELEMENTS as MAX_ELEMENTS
from psserver.common.messages import ALLREDUCE_MAX_NAME as MAX_NAME
from psserver.common.messages import ALLREDUCE_OPS as OPS
from psserver.errors import DataError, UsageError
from psserver.models.losses import resolve_loss
from psserver.trainer.session import remote_message
from psserver.utils.eval_metrics import check_outputs, concat_outputs, resolve_metric

if TYPE_CHECKING:
    from psserver.trainer.session import Session

log = logging.getLogger(__name__)

Call = Callable[[Callable[[], Any]], Any]
"""A call of the connection's, a failed one diagnosed and recovered (``Connection._call``)."""


def allreduce(call: Call, session: Session, value: float | torch.Tensor, name: str, op: str,
              num_trainers: int) -> float | torch.Tensor:
    """``ps.allreduce``: ``value`` (a number or a small tensor) reduced over the job's live
    trainers through the server, as Horovod's ``hvd.allreduce`` (``op``: ``average``, ``sum``,
    ``min``, ``max``): for metrics, as Horovod's ``metric_average``, not gradients. Every trainer
    of the job (``num_trainers``) calls it, in the same order (``name`` tells rounds apart); one
    that left meanwhile is not waited for. The result comes back as ``value`` came (a float,
    or a tensor of its dtype and device). A round that does not complete ends in a
    :class:`~psserver.errors.UsageError` after half the RPC timeout, naming who is missing."""
    tensor = value if isinstance(value, torch.Tensor) else None
    if tensor is None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise UsageError(f"ps.allreduce: a value is a number or a tensor, not {type(value).__name__}")
    if not isinstance(name, str) or len(name) > MAX_NAME or op not in OPS:
        raise UsageError(f"ps.allreduce: name is a str of at most {MAX_NAME} characters and op one of "
                         f"{', '.join(OPS)}")
    sent = torch.tensor(float(value), dtype=torch.float64) if tensor is None else tensor.detach().cpu()
    if sent.is_complex() or sent.numel() > MAX_ELEMENTS:
        raise UsageError(f"ps.allreduce: a value is real, of at most {MAX_ELEMENTS} elements (a metric)")

    def attempt() -> torch.Tensor:
        try:
            return session.call("allreduce", name, sent, op, num_trainers)
        except RuntimeError as e:
            message = remote_message(e)
            if message.startswith("allreduce "):  # the round, not the call, failed
                raise UsageError(f"ps.{message}") from None
            raise

    out = call(attempt)
    return float(out) if tensor is None else out.to(tensor.device, tensor.dtype)


def evaluate(call: Call, protocol: Any, data: Dataset | Iterable, metric: str | Callable | None,
             loss_fn: Callable | None, batch_size: int) -> float:
    """``ps.evaluate``: ``metric`` (default accuracy; a name of ``psserver.utils.eval_metrics``,
    ``"loss"`` with ``loss_fn``, or a callable ``(outputs, targets) -> float``) of the replica on
    the server's current parameters, over ``data``: a ``Dataset`` of ``(input, target)`` or an
    iterable of such batches. The replica is loaded from the server first (after this
    trainer's last update landed: sync waits for its round), and left in training mode.
    The batches' outputs are concatenated as the model returns them (a tensor along dim 0, a
    tuple or dict member by member), so a model that returns a tuple or dict needs a callable
    metric: a built-in one given such outputs is a :class:`~psserver.errors.UsageError`."""
    if callable(metric):
        fn = metric
    else:
        loss = resolve_loss(None, "cross_entropy") if loss_fn is None else loss_fn
        _, fn = resolve_metric(metric, "accuracy", loss)
    batches = DataLoader(data, batch_size=batch_size) if isinstance(data, Dataset) else data
    call(protocol.flush)
    outputs, targets = [], []
    for x, y in batches:
        outputs.append(call(lambda x=x: protocol.evaluate(x)))
        targets.append(y)
    if not outputs:
        log.warning("ps.evaluate: no batches to evaluate on")
        return math.nan
    if not all(isinstance(t, torch.Tensor) for t in targets):
        raise DataError("held-out targets must be tensors to compute a metric")
    whole = concat_outputs(outputs)
    check_outputs(fn, whole)
    try:
        return float(fn(whole, torch.cat(targets)))
    except ValueError as e:
        if callable(metric):  # the user's own: its error is theirs
            raise
        raise UsageError(f"metric {metric or 'accuracy'}: {e}") from None  # a built-in that does not fit
