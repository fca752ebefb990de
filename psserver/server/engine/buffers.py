"""The model's buffers on the server: BatchNorm's running statistics, ``num_batches_tracked``.

Every trainer's forward updates the buffers of its own replica; kept there, each trainer ends
with statistics of its own shard and the server's model with none (mxnet#1410, byteps#284). So
the server holds the buffers beside the parameters, trainers send theirs with each update and
load the server's with each step's parameters, and evaluation, checkpoints and export all read
the server's. ``--buffers``:

- ``average``: the mean of what the trainers sent: in ``sync`` the mean of a round's
  contributors, set when the round is applied (deterministic); in ``async`` and ``ssp`` the mean
  of the latest values of every live trainer, set at each update.
- ``rank0``: only trainer rank 0 sends (as DDP's ``broadcast_buffers``); the others load it.

On the wire they are one flat float64 tensor in the layout's order (``num_batches_tracked`` is
an int64, exact in float64 to 2^53), whatever the wire dtype: they are a few kilobytes.
No RPC here: the updaters commit, the step protocols carry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from psserver.common.tensors import flatten, unflatten_into
from psserver.config.ps import BUFFER_POLICIES


class ServerBuffers:
    """The buffers a server holds, and what trainers sent since (``receive``) until an update
    commits it (``commit``, under the updater's lock)."""

    def __init__(self, tensors: list[torch.Tensor], policy: str,
                 run: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        """``run``: where work on ``tensors`` runs, the stream of the shard that holds them on a
        GPU (``Shard.run``; None: the caller's), so a commit and a read are ordered with the
        updates and forwards there whatever thread, and stream, each call came on."""
        if policy not in BUFFER_POLICIES:
            raise ValueError(f"--buffers must be one of {', '.join(BUFFER_POLICIES)}, got {policy!r}")
        self._run = run or (lambda work: work())
        self.tensors = tensors
        self.policy = policy
        self.numel = sum(t.numel() for t in tensors)
        self._lock = threading.Lock()
        self._latest: dict[str, torch.Tensor] = {}
        self._set_constants()

    def _set_constants(self) -> None:
        """Where the buffers hold NaN or inf now, and what: a causal mask's ``-inf`` is a
        constant that trainers send back as it is; non-finite values anywhere else, or other
        ones there, are a statistic gone bad."""
        flat = self.flat()
        where = (~torch.isfinite(flat)).nonzero().reshape(-1)
        self._constant_at: torch.Tensor | None = where if where.numel() else None
        self._constant = flat[where]

    def flat(self) -> torch.Tensor:
        return self._run(lambda: flatten(self.tensors))

    def check(self, flat: object) -> torch.Tensor:
        """``flat`` as a trainer may send it (``ValueError``: not the server's buffers)."""
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() != self.numel:
            got = f"{tuple(flat.shape)} {flat.dtype}" if isinstance(flat, torch.Tensor) else type(flat).__name__
            raise ValueError(f"buffers of {got} for a model of {self.numel} buffer values")
        return flat.to(torch.float64)

    def acceptable(self, flat: torch.Tensor) -> bool:
        """Whether ``flat`` is finite wherever the server's buffers are (and equal to them where
        they are not: a constant mask)."""
        finite = torch.isfinite(flat)
        if bool(finite.all()):
            return True
        if self._constant_at is None:
            return False
        finite[self._constant_at] = True
        return bool(finite.all()) and bool((flat[self._constant_at] == self._constant).all())

    def receive(self, trainer: str, flat: torch.Tensor) -> bool:
        """``trainer``'s buffers with its update; False (not kept) when they went non-finite."""
        if not self.acceptable(flat):
            return False
        with self._lock:
            self._latest[trainer] = flat
        return True

    def commit(self, trainers: Iterable[str] | None = None) -> None:
        """Set the buffers to the mean of what ``trainers`` sent last (None: every live trainer
        that sent); nothing when none of them sent."""
        with self._lock:
            sent = [self._latest[t] for t in (self._latest if trainers is None else trainers) if t in self._latest]
        if sent:
            self._run(lambda: unflatten_into(torch.stack(sent).mean(0), self.tensors))

    def forget(self, trainer: str) -> None:
        with self._lock:
            self._latest.pop(trainer, None)

    def state(self) -> list[torch.Tensor]:
        """CPU copies, for a checkpoint of a server that holds them outside its shards."""
        return [t.detach().to("cpu", copy=True) for t in self.tensors]

    def load(self, values: Sequence[torch.Tensor]) -> None:
        if len(values) != len(self.tensors) or any(v.shape != t.shape for v, t in zip(values, self.tensors,
                                                                                      strict=True)):
            raise ValueError("the checkpoint's buffers do not fit the model's")
        with torch.no_grad():
            for t, v in zip(self.tensors, values, strict=True):
                t.copy_(v)
        self._set_constants()
