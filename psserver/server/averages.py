"""Small tensors reduced over the job's live trainers through server 0: Horovod's ``hvd.allreduce``
for metrics (``metric_average`` in its MNIST example), not for gradients.

A trainer's contribution joins the oldest round of its name that it has not contributed to (a
round is opened by the first contribution to a name); the round completes once every live
trainer has contributed and the job's trainers (``expected``, its shard count) are all counted:
those that contributed and those that left while it was open. A trainer that joins while a
round is open takes part in it: with trainers that come and go, rounds follow membership, not
ranks.
No RPC here: the endpoint calls :meth:`Averages.reduce` from its RPC thread and waits there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from psserver.common.messages import ALLREDUCE_MAX_ELEMENTS as MAX_ELEMENTS
from psserver.common.messages import ALLREDUCE_MAX_NAME as MAX_NAME
from psserver.common.messages import ALLREDUCE_OPS as OPS

MAX_ROUNDS = 1024
"""Open rounds at once (a name each, at most a few): past it a new name is refused."""


@dataclass
class _Round:
    op: str
    shape: tuple[int, ...]
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)
    """Trainers that left while it was open (they count as taken part)."""
    result: torch.Tensor | None = None
    taken: set[str] = field(default_factory=set)


class Averages:
    """The open rounds of every name, under one condition variable."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rounds: dict[str, list[_Round]] = {}

    def reduce(self, trainer: str, name: object, value: object, op: object, expected: object,
               live: Callable[[], list[str]], timeout: float, ranks_seen: Callable[[], int] = lambda: 0
               ) -> torch.Tensor:
        """``value`` of ``trainer`` reduced with every live trainer's of the same round of
        ``name``; ``ValueError`` for a bad argument, ``RuntimeError`` when the round does not
        complete within ``timeout`` (naming who did not contribute)."""
        name, value, op = _checked(name, value, op)
        if type(expected) is not int or not 1 <= expected <= 1 << 20:
            raise ValueError(f"allreduce {name!r}: the job's trainers are a count of 1 or more")
        deadline = time.monotonic() + timeout
        with self._cond:
            rounds = self._rounds.setdefault(name, [])
            rnd = next((r for r in rounds if trainer not in r.values and r.result is None), None)
            if rnd is None:
                if sum(len(r) for r in self._rounds.values()) >= MAX_ROUNDS:
                    raise ValueError(f"allreduce {name!r}: {MAX_ROUNDS} rounds are open already")
                rnd = _Round(op, tuple(value.shape))
                rounds.append(rnd)
            if (rnd.op, rnd.shape) != (op, tuple(value.shape)):
                raise ValueError(f"allreduce {name!r}: this trainer sent {op} of {list(value.shape)}, the round is "
                                 f"{rnd.op} of {list(rnd.shape)} (every trainer calls it alike)")
            rnd.values[trainer] = value
            self._cond.notify_all()
            while rnd.result is None:
                missing = set(live()) - set(rnd.values)
                # Every live trainer is in, and no trainer of the job is still to come: the round
                # counts ``expected`` (with those that left while it was open), or every rank
                # of the job has joined once (one that left before the round is not waited for).
                if not missing and (len(set(rnd.values) | rnd.gone) >= expected or ranks_seen() >= expected):
                    rnd.result = _combine(list(rnd.values.values()), rnd.op)
                    self._cond.notify_all()
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    late = expected - len(set(rnd.values) | rnd.gone)
                    del rnd.values[trainer]
                    if not rnd.values:
                        rounds.remove(rnd)
                    if not rounds:
                        del self._rounds[name]
                    who = ", ".join(sorted(missing)) or f"{late} of the job's {expected} trainers (not joined yet)"
                    raise RuntimeError(f"allreduce {name!r}: {who} did not take part within {timeout:g}s (every "
                                       "trainer calls it, in the same order)")
                self._cond.wait(min(left, 0.5))  # membership changes without telling this condition
            rnd.taken.add(trainer)
            if rnd.taken >= set(rnd.values):
                rounds.remove(rnd)
                if not rounds:
                    del self._rounds[name]
            return rnd.result

    def trainer_gone(self, trainer: str) -> None:
        """A trainer that left: a round waiting for it completes without it; one it contributed
        to keeps its value."""
        with self._cond:
            for name, rounds in list(self._rounds.items()):
                for rnd in list(rounds):
                    if rnd.result is None:
                        rnd.gone.add(trainer)
                    else:
                        rnd.taken.add(trainer)
                        if rnd.taken >= set(rnd.values):
                            rounds.remove(rnd)
                if not rounds:
                    del self._rounds[name]
            self._cond.notify_all()


def _checked(name: object, value: object, op: object) -> tuple[str, torch.Tensor, str]:
    if not isinstance(name, str) or len(name) > MAX_NAME:
        raise ValueError(f"allreduce: a name is a str of at most {MAX_NAME} characters")
    if op not in OPS:
        raise ValueError(f"allreduce: op must be one of {', '.join(OPS)}, got {str(op)[:40]!r}")
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_complex() \
            or value.numel() > MAX_ELEMENTS or value.device.type != "cpu":
        raise ValueError(f"allreduce {name!r}: a value is a real CPU tensor (or number) of at most {MAX_ELEMENTS} "
                         "elements")
    return name, value.detach().to(torch.float64).clone(), op


def _combine(values: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack(values)
    if op == "average":
        return stacked.mean(0)
    if op == "sum":
        return stacked.sum(0)
    return stacked.amin(0) if op == "min" else stacked.amax(0)
