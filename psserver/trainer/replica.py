"""Your own loop's way to step: :class:`Replica`, what ``ps.replica(model)`` made of the
connection. It owns the replica (the user's module, holding the server's values), the hooks
that count a step's samples from its forwards, and the steps: ``ps.step()`` (pushpull), or
with a server of ``--update diloco`` ``ps.sync()`` and ``ps.local_sgd(optimizer)``, and
``ps.rows(ids)`` for the embedding tables on the servers.

A replica steps through its connection (``psserver.trainer.connection``), which keeps the
membership: each call of the step protocol goes through the connection's ``_call`` (a failed
call diagnosed and recovered), each step done is counted in its position (``_count_step``),
and a signal leaves at the step boundary (:meth:`Connection.leave_on_signal`). The
:class:`Connection`'s own ``step``, ``sync``, ``local_sgd``, ``local_steps``, ``rows`` and
``tables`` are this object's, reached through it (:attr:`Connection.stepping`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from psserver.config import OptimizerConfig, TrainerConfig
from psserver.errors import UsageError
from psserver.trainer.counting import SampleCounter, sample_count
from psserver.trainer.local_sgd import LocalSGD
from psserver.trainer.membership import Membership

if TYPE_CHECKING:
    from psserver.trainer.session import Session

log = logging.getLogger(__name__)

PROTOCOLS = ("pushpull", "diloco")
"""The step protocols a replica trains with: the trainer computes, the server updates."""


def replica_config(config: TrainerConfig, optimizer: torch.optim.Optimizer | OptimizerConfig | None
                   ) -> TrainerConfig:
    """The connection's config for a replica's join: ``optimizer`` (the one the server should
    run) in it, refused for a step protocol or an overlap that a loop of its own cannot have."""
    if optimizer is not None:
        try:
            chosen = optimizer if isinstance(optimizer, OptimizerConfig) else OptimizerConfig.from_optimizer(optimizer)
        except (ValueError, TypeError, AttributeError) as e:
            raise UsageError(f"ps.replica(optimizer=...): {e}") from None
        config = dataclasses.replace(config, optimizer=chosen)
    if config.step not in (None, *PROTOCOLS):
        raise UsageError(f"ps.replica trains with step='pushpull' (the trainer computes) or 'diloco'; "
                         f"step={config.step!r} is psserver train's own loop")
    if config.overlap == "on":
        raise UsageError("overlap='on' is for ps.train_step: a loop that runs its own backward hands in each "
                         "gradient (ps.step) before its next forward")
    # --entry passes psserver train's config (--overlap auto): this loop never overlaps, and
    # the server must not count its steps as lagging.
    return dataclasses.replace(config, overlap="off")


def table_names(info: dict) -> list[str]:
    """The embedding tables the server's join answer describes, in the order of the ids' columns."""
    described = info.get("tables")
    return list(described["tables"]) if described else []


class Replica:
    """The user's own loop on a replica: :meth:`step`, or against a server of ``--update
    diloco`` :meth:`sync` and :meth:`local_sgd`; :meth:`rows` for embedding tables.

    ``ps.replica(model, optimizer=None)`` joins the server with ``model`` and returns it,
    holding the server's parameters and buffers: its layout (names, shapes, dtypes of its
    ``state_dict``) must be the server's, or it becomes the server's when the server holds none
    yet (its values the initial ones). It moves to the connection's ``device``. Batches are
    counted from its training forwards. A model made by ``torch.compile`` joins as the module
    it wraps (``_orig_mod``: its layout and class are the server's, as an uncompiled trainer's
    are), and the compiled module is returned, so the loop's forward stays compiled.
    ``optimizer``: the one the server should run, as Horovod's wrapper takes it (a
    ``torch.optim`` optimizer over ``model.parameters()``, one parameter group: its class and
    hyperparameters travel, never its state), or an ``OptimizerConfig``. The first trainer's
    choice sets a server started without ``--optimizer``; a different one is refused. A join
    answered with a step protocol other than pushpull or diloco leaves and is a
    :class:`~psserver.errors.UsageError`."""

    def __init__(self, ps: Membership, session: Session, compiled: nn.Module | None = None) -> None:
        if session.step_protocol not in PROTOCOLS:
            session.leave()
            raise UsageError(f"the server answered with --step {session.step_protocol}: ps.step needs pushpull "
                             "(a server that runs every step with --compute server cannot serve a replica)")
        self._ps = ps
        self._session = session
        self._half: Any = session.protocol
        self.model: nn.Module = self._half.model if compiled is None else compiled
        """The replica: the module joined, on the connection's device (a compiled one's wrapper
        shares it, and stays compiled)."""
        self._counter = SampleCounter()
        self._hooks: list[Any] = []
        self._wrapper: Any = None  # the last DistributedOptimizer made over this replica (its hooks count passes)
        self._inner_hooks: list[LocalSGD] = []  # local_sgd's, on the user's inner optimizers

    def open(self) -> None:
        """Load the server's values into the replica, and count its forwards from now on."""
        self._ps._call(self._half.open)
        self._hooks = [self.model.register_forward_pre_hook(self._counter, with_kwargs=True)]
        self._hooks += [p.register_post_accumulate_grad_hook(self._counter.passed)
                        for p in self.model.parameters() if p.requires_grad]

    def unhook(self) -> None:
        """Stop counting the replica's forwards (the connection leaves, or rejoins)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def wrapped_by(self, wrapper: Any) -> None:
        """``wrapper`` (a :class:`~psserver.trainer.optimizer.DistributedOptimizer`, the last made
        over this connection) counts the backward passes: :meth:`step` tells it an update went."""
        self._wrapper = wrapper

    # ---- pushpull: one update a step ------------------------------------------------------

    def step(self, *, samples: int | None = None, loss: float | torch.Tensor | None = None) -> None:
        """End this step: the gradient in the replica's ``.grad`` goes to the server (one update,
        or this trainer's share of a sync round), the server's fresh parameters and buffers come
        back into the replica, and its gradients are zeroed. ``samples``: the step's samples
        (default: for each backward pass since the last step, the batch size, dim 0 of the first
        input, of its first forward of the replica with grad enabled in training mode, else with
        grad enabled: :class:`~psserver.trainer.counting.SampleCounter`);
        ``loss``: shown by ``psserver status`` for this trainer.

        Raises :class:`~psserver.errors.Evicted` or :class:`~psserver.errors.ServerLost` when the
        server evicted this trainer or is gone (with ``reconnect=True`` the script re-executes
        instead); after SIGTERM or SIGINT, the step done, it leaves and exits 128 + the signal."""
        if self._session.step_protocol == "diloco":
            raise UsageError("the server runs --update diloco: step with your own optimizer and hand in each window "
                             "with ps.sync(), or let ps.local_sgd(optimizer, every=H) do it")
        given = None if samples is None else sample_count(samples)
        counted = self._counter.take()
        n = counted if given is None else given
        half = self._half
        self._ps._call(lambda: half.push_pull(n))
        if self._wrapper is not None:  # a loop that mixes ps.step() with the wrapper's step()
            self._wrapper.stepped()
        self._ps._count_step(n, loss)
        self._ps.leave_on_signal()
        if samples is None:
            self._ps._check_count()

    def rows(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """With embedding tables on the servers (``psserver serve --model`` of a model that has
        them): the rows of a batch's ids (``[batch, tables]`` integers, column t for table t of
        :attr:`tables`), one ``[batch, width]`` tensor per table, as the model's ``forward(rows,
        dense)`` takes them; their gradients go up with the next :meth:`step` (sparsely: only
        the rows this batch used)."""
        try:
            return self._ps._call(lambda: self._half.rows(ids))
        except ValueError as e:
            raise UsageError(f"ps.rows: {e}") from None

    @property
    def tables(self) -> list[str]:
        """The embedding tables on the servers, in the order of the ids' columns (empty: none)."""
        return table_names(self._session.info)

    # ---- DiLoCo (a server of --update diloco): local steps, a sync every H -------------------

    def sync(self, *, samples: int | None = None, loss: float | torch.Tensor | None = None) -> int:
        """Hand in this window: the pseudo-gradient (the global weights of the last sync minus
        the replica's) goes to the server, whose outer optimizer applies it (sync: in its round
        of K), and the new global weights come back into the replica; the server's outer steps
        after it. ``samples``: the window's (default: counted from the replica's forwards, as
        :meth:`step` counts them). Under :meth:`local_sgd` each H-th inner step calls it."""
        half = self._diloco("sync")
        n = self._counter.take() if samples is None else sample_count(samples)
        if half.window_steps == 0 and any(hook.active for hook in self._inner_hooks):
            # The inner optimizer's steps make the windows and none came since the last sync (a
            # flush right after local_sgd's own): nothing to hand in. Sent, its zero
            # pseudo-gradient would be one of a sync round's K and an outer step of its own. Its
            # samples (forwards since, or samples=) count with the next window.
            half.add_samples(n)
        elif half.window_steps == 0:  # a loop of its own: the window counts as one step
            half.inner_step_done(n)
            self._ps._count_step(n, loss)
        else:
            half.add_samples(n)
        outer = self._ps._call(half.sync)
        self._ps.leave_on_signal()
        return outer

    def local_sgd(self, optimizer: torch.optim.Optimizer, *, every: int | None = None) -> LocalSGD:
        """Count ``optimizer``'s steps (the user's inner optimizer over the replica's parameters)
        as the window's inner steps and sync after every ``every`` of them (default: the
        connection's ``local_steps``, else 100; with the server's ``--dynamic-local-steps``, as
        the server sizes each window). Returns the hook; its ``remove()`` stops it."""
        half = self._diloco("local_sgd")
        if every is not None:
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise UsageError(f"ps.local_sgd: every is an int >= 1, got {every!r}")
            if half.stream is not None:
                half.stream.set_local_steps(every)
            half.base_steps = half.local_steps = every

        def stepped() -> None:
            n = self._counter.take()
            half.inner_step_done(n)
            self._ps._count_step(n, None)
            if half.due or half.stream is not None:
                self._ps._call(half.advance)
            self._ps.leave_on_signal()

        hook = LocalSGD(optimizer, stepped)
        self._inner_hooks.append(hook)
        return hook

    @property
    def local_steps(self) -> int:
        """Inner steps of this window (DiLoCo's H; the server's, with ``--dynamic-local-steps``)."""
        return self._diloco("local_steps").local_steps

    def _diloco(self, what: str) -> Any:
        if self._session.step_protocol != "diloco":
            raise UsageError(f"ps.{what} is for a server of --update diloco (this one runs --update "
                             f"{self._session.info.get('update')}: use ps.step())")
        return self._half

    def __repr__(self) -> str:
        return f"<psserver Replica {type(self.model).__name__} ({self._session.step_protocol})>"
