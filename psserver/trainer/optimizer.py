"""``psserver.DistributedOptimizer``: Horovod's and BytePS's optimizer wrapper, for loops that
already call ``opt.step()``.

Horovod wraps the user's optimizer, averages the gradients across workers and steps that
optimizer locally. On a parameter server the update is the server's (its one shared optimizer),
so this optimizer holds no state of its own: ``step()`` sends the gradient in ``.grad`` and
brings the server's fresh parameters back into the replica (``ps.step()``, the step of the
connection's :class:`~psserver.trainer.replica.Replica`). What a Horovod loop does around it
works unchanged:

- ``backward_passes_per_step=K``: K backward passes accumulate (sum) into ``.grad``, then one
  ``step()`` sends one update (divide the loss by K, as in any accumulation loop, and K
  micro-batches of B give the update of one batch of K*B). More than K passes before a step
  is an error, as in Horovod.
- AMP: ``opt.synchronize()`` before ``scaler.unscale_(opt)`` and ``clip_grad_norm_``, then
  ``with opt.skip_synchronize(): scaler.step(opt)`` (horovod#1089). Nothing needs reducing
  before the unscale here (the server reduces), so ``synchronize()`` only marks the gradient
  final; the step inside ``skip_synchronize`` sends it, unscaled and clipped. A step the
  scaler skips (non-finite gradients) sends nothing.
- ``param_groups[i]["lr"]`` mirrors the server's learning rate (its ``--lr-schedule``) after
  every step; the server's rate is the one that applies.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from psserver.errors import UsageError
from psserver.trainer.replica import Replica

if TYPE_CHECKING:
    from psserver.trainer.connection import Connection

log = logging.getLogger(__name__)

_COUNTING: weakref.WeakKeyDictionary[Any, DistributedOptimizer] = weakref.WeakKeyDictionary()
"""The wrapper whose hooks count backward passes, per connection: the last one made over it."""


class DistributedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose ``step()`` is one update on the parameter server."""

    def __init__(self, ps: Connection, named_parameters: Iterable[tuple[str, nn.Parameter]] | Iterable[nn.Parameter],
                 backward_passes_per_step: int = 1) -> None:
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise UsageError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
        if ps.model is None:
            raise UsageError("DistributedOptimizer wraps a replica's parameters: call ps.replica(model) first")
        given = list(named_parameters)
        if any(isinstance(p, dict) for p in given):
            raise UsageError("DistributedOptimizer takes no parameter groups: psserver's optimizer is the server's "
                             "(psserver serve --optimizer/--lr), over the whole model: pass model.named_parameters()")
        params = [p[1] if isinstance(p, tuple) else p for p in given]
        ours = {id(p) for p in ps.model.parameters()}
        if not params or any(id(p) not in ours for p in params):
            raise UsageError("DistributedOptimizer takes the replica's parameters (ps.replica(model)."
                             "named_parameters()): each one goes to the server with every step")
        mine = {id(p) for p in params}
        left_out = [n for n, p in ps.model.named_parameters() if p.requires_grad and id(p) not in mine]
        if left_out:  # ps.step sends every gradient: a subset would be updated whole, silently
            more = ", ..." if len(left_out) > 3 else ""
            raise UsageError(f"DistributedOptimizer got {len(params)} of the replica's parameters, not "
                             f"{', '.join(left_out[:3])}{more}: psserver's optimizer is the server's, over the whole "
                             "model: pass model.named_parameters()")
        super().__init__(params, {"lr": ps.lr})
        self.ps = ps
        self.backward_passes_per_step = backward_passes_per_step
        self._passes: dict[nn.Parameter, int] = {}
        self._skip_sync = False
        self._synchronized = False
        self._mirrored = ps.lr
        previous = _COUNTING.get(ps)
        if previous is not None:  # its hooks would count this one's passes against its own setting
            previous.remove_hooks()
        _COUNTING[ps] = self
        replica = getattr(ps, "stepping", None)
        if isinstance(replica, Replica):  # a plain ps.step() between this one's steps restarts its count
            replica.wrapped_by(self)
        self._hooks = [p.register_post_accumulate_grad_hook(self._count_pass) for p in params if p.requires_grad]

    def remove_hooks(self) -> None:
        """Stop counting backward passes: a newer wrapper over the same connection counts them."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._passes.clear()

    def stepped(self) -> None:
        """An update went (``ps.step()``, directly or from :meth:`step`): count passes anew."""
        self._passes.clear()

    def _count_pass(self, p: nn.Parameter) -> None:
        n = self._passes.get(p, 0) + 1
        if n > self.backward_passes_per_step:
            raise UsageError(f"gradients were computed {n} times before DistributedOptimizer.step() "
                             f"(backward_passes_per_step={self.backward_passes_per_step}): raise "
                             "backward_passes_per_step to accumulate that many")
        self._passes[p] = n

    def synchronize(self) -> None:
        """Mark the accumulated gradient final (Horovod's reduce point). The server reduces, so
        nothing is sent yet: unscale and clip ``.grad`` now; ``step()`` sends it."""
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """A ``step()`` inside sends the gradient as it is after ``synchronize()``, unscaled and
        clipped (Horovod: it skips a second reduce; AMP's ``scaler.step(opt)`` goes inside)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Send the accumulated gradient as one update and load the server's fresh parameters;
        ``closure`` (re-evaluating the loss) runs first, as for any optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._skip_sync and not self._synchronized:
            log.debug("step() inside skip_synchronize() without synchronize() first")
        lr = self.param_groups[0]["lr"]
        if lr != self._mirrored:
            log.warning("DistributedOptimizer: param_groups' lr was set to %g, but the server's learning rate "
                        "applies (psserver serve --lr / --lr-schedule)", lr)
        self.ps.step(loss=loss)
        self.stepped()
        self._synchronized = False
        self._mirrored = self.ps.lr
        for group in self.param_groups:
            group["lr"] = self._mirrored
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the replica's gradients and the count of backward passes."""
        super().zero_grad(set_to_none)
        self._passes.clear()

    def __repr__(self) -> str:
        return (f"psserver.DistributedOptimizer(lr={self.param_groups[0]['lr']}, "
                f"backward_passes_per_step={self.backward_passes_per_step})")
