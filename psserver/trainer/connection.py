"""psserver as a library: :func:`connect` gives a :class:`Connection`, this process's membership
of a parameter server, and the user's own loop trains through it.

::

    with psserver.connect("10.0.0.5:29500", rank=0, num_trainers=2) as ps:
        model = ps.replica(MyNet())          # the server's parameters and buffers loaded
        loader = DataLoader(ds, batch_size=64, sampler=ps.sampler(ds))
        for epoch in range(ps.epoch, 3):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                loss_fn(model(x), y).backward()
                ps.step()                    # gradient up, fresh parameters down, grads zeroed

The connection is the same membership ``psserver train`` has (``psserver.trainer.session``):
a heartbeat thread keeps it alive while the user's code is busy between steps, SIGTERM and
SIGINT leave after the step in flight, and a failed step is diagnosed by asking the server.
RPC cannot be set up twice in one process, so with ``reconnect=True`` a trainer that was
evicted or lost its server re-executes its own script, which connects again and continues
from :attr:`Connection.epoch` (and the sampler skips what that epoch already trained on).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from psserver.common import torch_rpc
from psserver.common.messages import ALLREDUCE_MAX_ELEMENTS as MAX_ELEMENTS
from psserver.common.messages import ALLREDUCE_MAX_NAME as MAX_NAME
from psserver.common.messages import ALLREDUCE_OPS as OPS
from psserver.common.messages import Report
from psserver.config import OptimizerConfig, TrainerConfig, parse_host_port
from psserver.config.env import default_rank, default_server_address, default_world_size
from psserver.errors import DataError, ServerLost, UsageError
from psserver.models.calling import input_batch_size
from psserver.models.losses import resolve_loss
from psserver.trainer.counting import SampleCounter, sample_count
from psserver.trainer.local_sgd import LocalSGD
from psserver.trainer.recovery import FAILED, diagnose, join, recover, shard_count
from psserver.trainer.rejoin import Position, script_command_line, take_position
from psserver.trainer.sampler import ResumableSampler
from psserver.trainer.session import Session, remote_message
from psserver.trainer.stop_signals import StopSignals
from psserver.utils.divergence import GrowthWatch
from psserver.utils.eval_metrics import check_outputs, concat_outputs, resolve_metric
from psserver.utils.memory import configure_host_allocator

log = logging.getLogger(__name__)


class Connection:
    """This process's membership of a psserver job, for a training loop of the user's own.

    Made by :func:`psserver.connect`; use it as a context manager, which leaves the server on
    the way out (after an exception too, saying so). It joins at :meth:`replica` (the model's
    layout is part of the join), or at :meth:`parameter_rrefs` for the RPC tutorial's loop.
    """

    def __init__(self, config: TrainerConfig, *, handle_signals: bool = True, announce_errors: bool = True,
                 rejoin_command: Callable[[], list[str] | None] = script_command_line,
                 retry_first_join: bool = False) -> None:
        """``announce_errors``: log that the connection leaves because of an exception (a
        command that reports the exception itself says False). ``rejoin_command``: the command
        line a rejoin re-executes (default: this script's own; ``psserver train``'s, which is
        None inside a program that runs the CLI in-process, so that it is never re-executed).
        ``retry_first_join``: a first join that failed as the RPC group changed under it is tried
        again in a fresh process without ``reconnect`` too (``psserver train``; a library script
        is re-executed only when it asked for ``reconnect``)."""
        self.config = config
        self._announce = announce_errors
        configure_host_allocator(config.allocator)
        resumed = take_position()
        self.resumed = resumed is not None and not resumed.first_join_tries
        """Whether this process continues a trainer that rejoined (``reconnect=True``)."""
        self._pos = resumed or Position()
        self._resume: tuple[int, int] | None = (self._pos.epoch, self._pos.epoch_samples) if resumed else None
        """``(epoch, samples)`` a sampler skips once: what the epoch trained before a rejoin or a restart."""
        self._argv = rejoin_command()
        self._retry_first_join = retry_first_join
        self._stop = StopSignals()
        if handle_signals:
            self._stop.__enter__()
        self.session: Session | None = None
        self.model: nn.Module | None = None
        """The replica :meth:`replica` was given (None before)."""
        self._counter = SampleCounter()
        self._hook: Any = None
        self._pass_hooks: list[Any] = []
        self._samplers: list[ResumableSampler] = []
        self._wrapper: Any = None  # the last DistributedOptimizer made over this connection (its hooks count passes)
        self._warned_count = False
        self._losses = GrowthWatch()  # a loss gone far off while finite is told once
        self._rejoin_hooks: list[Callable[[], None]] = []
        self.steps_per_epoch: int | None = None
        """Set by a loop that knows it (``psserver train``'s): a step made again after a lost server
        may then be the last of the epoch before."""
        self._closed = False
        self._builds = True  # a model of the server's that is code is built here (ps.parameter_rrefs: never)
        atexit.register(self._at_exit)

    # ---- joining ---------------------------------------------------------------------------

    def join(self, model: nn.Module | None = None) -> Session:
        """Join the server: with ``model``, or with the model of the connection's config (its
        ``--model``, else the server's). :meth:`replica` and :meth:`parameter_rrefs` join
        through it; ``psserver train``'s own loop calls it and steps with :meth:`train_step`."""
        if self.session is not None:
            raise UsageError("this connection has joined already: one replica per connection (and per process)")
        if self._closed:
            raise UsageError("this connection has left the server")
        if model is not None and not isinstance(model, nn.Module):
            raise UsageError(f"ps.replica takes an nn.Module, got {type(model).__name__}")
        self.session = self._join(model)
        return self.session

    def replica(self, model: nn.Module, *, optimizer: torch.optim.Optimizer | OptimizerConfig | None = None
                ) -> nn.Module:
        """Join the server with ``model`` and return it, holding the server's parameters and
        buffers: its layout (names, shapes, dtypes of its ``state_dict``) must be the server's,
        or it becomes the server's when the server holds none yet (its values the initial ones).
        It moves to the connection's ``device``. Batches are counted from its training forwards.
        A model made by ``torch.compile`` joins as the module it wraps (``_orig_mod``: its layout and
        class are the server's, as an uncompiled trainer's are), and the compiled module is
        returned, so the loop's forward stays compiled.

        ``optimizer``: the one the server should run, as Horovod's wrapper takes it (a
        ``torch.optim`` optimizer over ``model.parameters()``, one parameter group: its class and
        hyperparameters travel, never its state), or an ``OptimizerConfig``. The first trainer's
        choice sets a server started without ``--optimizer``; a different one is refused."""
        if optimizer is not None:
            try:
                chosen = optimizer if isinstance(optimizer, OptimizerConfig) else \
                    OptimizerConfig.from_optimizer(optimizer)
            except (ValueError, TypeError, AttributeError) as e:
                raise UsageError(f"ps.replica(optimizer=...): {e}") from None
            self.config = dataclasses.replace(self.config, optimizer=chosen)
        if self.config.step not in (None, "pushpull", "diloco"):
            raise UsageError(f"ps.replica trains with step='pushpull' (the trainer computes) or 'diloco'; "
                             f"step={self.config.step!r} is psserver train's own loop")
        if self.config.overlap == "on":
            raise UsageError("overlap='on' is for ps.train_step: a loop that runs its own backward hands in each "
                             "gradient (ps.step) before its next forward")
        # --entry passes psserver train's config (--overlap auto): this loop never overlaps, and
        # the server must not count its steps as lagging.
        self.config = dataclasses.replace(self.config, overlap="off")
        inner = getattr(model, "_orig_mod", None) if isinstance(model, nn.Module) else None
        compiled = model if isinstance(inner, nn.Module) else None
        self.join(inner if compiled is not None else model)
        assert self.session is not None
        if self.session.step_protocol not in ("pushpull", "diloco"):
            self.session.leave()
            raise UsageError(f"the server answered with --step {self.session.step_protocol}: ps.step needs pushpull "
                             "(a server that runs every step with --compute server cannot serve a replica)")
        half = self.session.protocol
        # The same module, on the connection's device (a compiled one's wrapper shares it).
        self.model = half.model if compiled is None else compiled
        try:
            self._call(half.open)
        except BaseException:
            self._leave(None)
            raise
        self._hook = self.model.register_forward_pre_hook(self._counter, with_kwargs=True)
        self._pass_hooks = [p.register_post_accumulate_grad_hook(self._counter.passed)
                            for p in self.model.parameters() if p.requires_grad]
        return self.model

    def parameter_rrefs(self) -> list[torch.distributed.rpc.RRef]:
        """RRefs to the server's parameters, for PyTorch's RPC tutorial loop: ``with
        dist_autograd.context() as ctx``, ``out = ps.forward(x)``, ``dist_autograd.backward(ctx,
        [loss])``, and a ``torch.distributed.optim.DistributedOptimizer`` over these RRefs whose
        ``step(ctx)`` goes through the server's one shared optimizer: the one it names sets a
        server started without ``--optimizer``, another than the server's is refused (a
        ``ValueError`` from its constructor). The server must hold the model's code
        (``psserver serve --model``), since it runs the forward."""
        if self.session is None:
            if self.config.step not in (None, "plain"):
                raise UsageError(f"ps.parameter_rrefs speaks step='plain'; this connection asked for "
                                 f"{self.config.step!r}")
            self.config = dataclasses.replace(self.config, step="plain", compute=None)
            self._builds = False  # the server runs the model: this trainer builds none of its code
            self.join()
        assert self.session is not None
        if self.session.step_protocol != "plain":
            raise UsageError(f"ps.parameter_rrefs needs step='plain'; this connection trains with "
                             f"{self.session.step_protocol!r} (ps.replica)")
        return list(self.session.info["param_rrefs"])

    def forward(self, x: Any) -> torch.Tensor:
        """The server's model on ``x`` (the RPC tutorial's remote forward), inside the caller's
        ``dist_autograd`` context: its backward reaches the server's parameters."""
        session = self._joined("forward")
        if session.step_protocol != "plain":
            raise UsageError("ps.forward is the RPC tutorial's path: call ps.parameter_rrefs() first (no ps.replica)")
        self.leave_on_signal()  # the step before ended with its optimizer's step(ctx)
        # Under no_grad or outside a dist_autograd context no backward can reach the server: an
        # evaluation, which opens no step there and counts none here.
        training = torch.is_grad_enabled() and torch_rpc.current_autograd_context_id() is not None
        out = self._call(lambda: session.call("forward", x, training))
        if training:
            self._count_step(input_batch_size(x), None)
        return out

    def _join(self, model: nn.Module | None) -> Session:
        session = join(self.config, self._pos if self.resumed or self._pos.first_join_tries else None, self._stop,
                       model, self._argv, build=self._builds, retry_first_join=self._retry_first_join)
        if self._pos.report is not None:
            session.report = Report(**self._pos.report)
        if session.continued is not None:
            self._continue(session.continued)
        return session

    def _skip(self, epoch: int, take: bool) -> int:
        """How many samples of ``epoch`` the first sampler to go through it skips (those trained
        on before a rejoin or a restart): taken once, by one sampler (a held-out sampler made
        with ``ps.sampler`` too goes through its epoch whole)."""
        pending = self._resume
        if pending is None or pending[0] != epoch:
            return 0
        if take:
            self._resume = None
        return pending[1]

    def _continue(self, at: dict[str, int]) -> None:
        """Take up the position of this rank's last trainer, which left the job unfinished."""
        pos = self._pos
        pos.epoch, pos.epoch_samples, pos.batch_idx = at["epoch"], at["epoch_samples"], at["batch_idx"]
        pos.steps, pos.samples = at["steps"], at["samples"]
        pos.samples_before = pos.samples
        self.resumed = True
        self._resume = (pos.epoch, pos.epoch_samples)
        log.warning("rank %d continues where its last trainer stopped: epoch %d, %d of its samples in it, step %d "
                 "(psserver train --start-over, or TrainerConfig(start_over=True), starts over)", self.config.rank,
                 pos.epoch, pos.epoch_samples, pos.steps)

    # ---- training --------------------------------------------------------------------------

    def sampler(self, dataset: Dataset, *, shuffle: bool = True, seed: int = 0,
                drop_last: bool = False) -> ResumableSampler:
        """This trainer's shard of ``dataset``: a ``DistributedSampler`` over ``num_trainers``
        shards at this rank (call its ``set_epoch`` each epoch), which after a rejoin resumes
        the epoch it was in without the samples already trained on. Before the join (on any
        rank) the shard count must come from ``num_trainers`` or ``$WORLD_SIZE``: the server's
        sync K is known only from its answer to the join."""
        sampler = ResumableSampler(dataset, num_replicas=self.num_trainers, rank=self.config.rank, shuffle=shuffle,
                                   seed=seed, drop_last=drop_last, on_epoch=self._on_epoch, skip=self._skip,
                                   epoch=self._pos.epoch)
        self._samplers.append(sampler)
        return sampler

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
        session = self._joined("step")
        if self.model is None:
            raise UsageError("ps.step trains a replica: call ps.replica(model) first")
        if session.step_protocol == "diloco":
            raise UsageError("the server runs --update diloco: step with your own optimizer and hand in each window "
                             "with ps.sync(), or let ps.local_sgd(optimizer, every=H) do it")
        given = None if samples is None else sample_count(samples)
        counted = self._counter.take()
        n = counted if given is None else given
        half = session.protocol
        self._call(lambda: half.push_pull(n))
        if self._wrapper is not None:  # a loop that mixes ps.step() with the wrapper's step()
            self._wrapper.stepped()
        self._advance(n, loss)
        if samples is None:
            self._check_count()

    # ---- DiLoCo (a server of --update diloco): local steps, a sync every H -------------------

    def sync(self, *, samples: int | None = None, loss: float | torch.Tensor | None = None) -> int:
        """Hand in this window: the pseudo-gradient (the global weights of the last sync minus
        the replica's) goes to the server, whose outer optimizer applies it (sync: in its round
        of K), and the new global weights come back into the replica; the server's outer steps
        after it. ``samples``: the window's (default: counted from the replica's forwards, as
        :meth:`step` counts them). Under :meth:`local_sgd` each H-th inner step calls it."""
        half = self._diloco("sync")
        n = self._counter.take() if samples is None else sample_count(samples)
        if half.window_steps == 0:  # a loop of its own: the window counts as one step
            half.inner_step_done(n)
            self._count_step(n, loss)
        else:
            half.window_samples += n
        outer = self._call(half.sync)
        self.leave_on_signal()
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
            half.base_steps = half.local_steps = every

        def stepped() -> None:
            n = self._counter.take()
            half.inner_step_done(n)
            self._count_step(n, None)
            if half.due:
                self._call(half.sync)
            self.leave_on_signal()

        return LocalSGD(optimizer, stepped)

    @property
    def local_steps(self) -> int:
        """Inner steps of this window (DiLoCo's H; the server's, with ``--dynamic-local-steps``)."""
        return self._diloco("local_steps").local_steps

    def _diloco(self, what: str) -> Any:
        session = self._joined(what)
        if self.model is None:
            raise UsageError(f"ps.{what} trains a replica: call ps.replica(model) first")
        if session.step_protocol != "diloco":
            raise UsageError(f"ps.{what} is for a server of --update diloco (this one runs --update "
                             f"{session.info.get('update')}: use ps.step())")
        return session.protocol

    def rows(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """With embedding tables on the servers (``psserver serve --model`` of a model that has
        them): the rows of a batch's ids (``[batch, tables]`` integers, column t for table t of
        :attr:`tables`), one ``[batch, width]`` tensor per table, as the model's ``forward(rows,
        dense)`` takes them; their gradients go up with the next :meth:`step` (sparsely: only
        the rows this batch used)."""
        session = self._joined("rows")
        if self.model is None:
            raise UsageError("ps.rows feeds a replica: call ps.replica(model) first")
        try:
            return self._call(lambda: session.protocol.rows(ids))
        except ValueError as e:
            raise UsageError(f"ps.rows: {e}") from None

    @property
    def tables(self) -> list[str]:
        """The embedding tables on the servers, in the order of the ids' columns (empty: none)."""
        described = self._joined("tables").info.get("tables")
        return list(described["tables"]) if described else []

    def train_step(self, x: Any, y: Any, *, samples: int,
                   on_failure: Callable[[Exception], None] | None = None) -> float:
        """``psserver train``'s step, for any ``--step``: the step protocol runs forward, the
        loss and backward on ``(x, y)`` (on the trainer, or on the server) and hands the update
        in; the batch's loss. ``on_failure`` sees a failed step's exception first (the first
        step's: data that does not fit the model is the user's error, not a lost server)."""
        session = self._joined("train_step")
        loss = self._call(lambda: session.protocol.step(x, y), on_failure)
        self._count_step(samples, loss)
        return loss

    def _advance(self, samples: int, loss: float | torch.Tensor | None) -> None:
        """Count a step done; leave after it when a signal asked to."""
        self._count_step(samples, loss)
        self.leave_on_signal()

    def leave_on_signal(self) -> None:
        """After SIGTERM or SIGINT (:attr:`stop_signal`): hand in what is owed, leave, and exit
        128 + the signal's number (``SystemExit``); nothing before a signal. ``ps.step`` and
        ``ps.forward`` call it at their step boundary."""
        if self._stop.signum is not None:
            code = 128 + self._stop.signum
            log.warning("received %s: handing in step %d and leaving psserver (exit %d)",
                        signal.Signals(self._stop.signum).name, self._pos.steps, code)
            self._leave(None)
            raise SystemExit(code)

    def _count_step(self, samples: int, loss: float | torch.Tensor | None) -> None:
        pos = self._pos
        pos.steps += 1
        pos.samples += samples
        pos.epoch_samples += samples
        if loss is not None:
            pos.loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            diverging = self._losses.observe(pos.loss)
            if diverging:
                log.warning("loss %s", diverging)
        rate = (pos.samples - pos.samples_before) / max(1e-6, time.monotonic() - pos.t_start)
        assert self.session is not None
        # psserver train's loop counts the batch after the step: the report says where the next starts.
        batches = pos.batch_idx + 1 if self.steps_per_epoch is not None else pos.batch_idx
        self.session.report = Report(pos.steps, pos.samples, pos.loss, rate, epoch=pos.epoch,
                                     epoch_samples=pos.epoch_samples, batch_idx=batches)

    def _call(self, fn: Callable[[], Any], on_failure: Callable[[Exception], None] | None = None) -> Any:
        """A call of the step; a failed one is diagnosed by asking the server (evicted, lost:
        :func:`~psserver.trainer.recovery.recover`; a failure of the call itself is raised)."""
        assert self.session is not None
        try:
            return fn()
        except Exception as e:
            if on_failure is not None:
                on_failure(e)
            if not isinstance(e, RuntimeError | TimeoutError):
                raise
            owed = getattr(self.session.protocol, "owed_samples", lambda: None)()
            if owed is not None:
                self._roll_back(owed)
            self._pos.report = asdict(self.session.report) if self.session.report is not None else None
            self._unhook()
            recover(self.session, self.config, e, self._pos, self._stop, self._run_before_rejoin, self._argv)

    def _roll_back(self, samples: int) -> None:
        """A failed call did not hand in the gradient of the last step counted (of ``samples``):
        that step is made again after the rejoin, under the same number, so the server applies
        it once, whether the process that died had applied it or not."""
        pos = self._pos
        if pos.epoch_samples >= samples:
            pos.epoch_samples -= samples
            pos.batch_idx = max(0, pos.batch_idx - 1)
        elif pos.epoch > 0 and self.steps_per_epoch:  # the last step of the epoch before
            pos.epoch -= 1
            pos.batch_idx = self.steps_per_epoch - 1
            pos.epoch_samples = 0  # (psserver train's loop, the one that sets steps_per_epoch, resumes by batch_idx)
        else:
            log.warning("the gradient of step %d was not handed in and cannot be made again (it ended an epoch of "
                        "unknown length): it is lost", pos.steps)
            return
        pos.steps -= 1
        pos.samples -= samples

    def before_rejoin(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` before this process re-executes itself to rejoin (``reconnect=True``):
        close what would outlive the process image, such as a DataLoader's worker processes."""
        self._rejoin_hooks.append(fn)

    def _run_before_rejoin(self) -> None:
        for fn in self._rejoin_hooks:
            fn()

    def _check_count(self) -> None:
        """Warn (once) when the samples counted in this epoch exceed what this connection's
        samplers handed out in it: the counter read a dimension that is not the batch's."""
        if self._warned_count or not self._samplers:
            return
        pos = self._pos
        handed = sum(s.handed_out(pos.epoch) for s in self._samplers)
        if pos.epoch_samples > handed:
            self._warned_count = True
            log.warning("ps.step counted %d samples in epoch %d, more than ps.sampler has handed out (%d): the count "
                        "reads dim 0 of the model's first input, which is not the batch's here (a sequence model fed "
                        "(T, B, ...) counts T); pass ps.step(samples=...)", pos.epoch_samples, pos.epoch, handed)

    def _on_epoch(self, epoch: int) -> None:
        if epoch != self._pos.epoch:
            self._pos.epoch = epoch
            self._pos.epoch_samples = 0

    # ---- what the server says --------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This trainer's rank (its data shard)."""
        return self.config.rank

    @property
    def num_trainers(self) -> int:
        """The number of data shards: ``num_trainers`` (``$WORLD_SIZE``), else the server's sync
        K, else 1 for rank 0; before the join, ``num_trainers`` only (else a UsageError, which
        :meth:`sampler` raises too)."""
        if self.session is None:
            if self.config.num_trainers is None:
                raise UsageError("ps.num_trainers before the join: call ps.replica(model) first, or pass "
                                 "num_trainers to psserver.connect (or set $WORLD_SIZE)")
            return self.config.num_trainers
        return shard_count(self.config, self.session.info)

    @property
    def epoch(self) -> int:
        """The epoch to start from: 0, or after a rejoin the epoch the trainer was in."""
        return self._pos.epoch

    @property
    def steps(self) -> int:
        """Steps this trainer has done (across rejoins)."""
        return self._pos.steps

    @property
    def position(self) -> Position:
        """Where this trainer is in its run (epoch, steps, samples; ``psserver train`` keeps
        its batch index there): what a rejoined process continues from."""
        return self._pos

    @property
    def stop_signal(self) -> int | None:
        """SIGTERM or SIGINT once one arrived (the loop leaves at its next step boundary)."""
        return self._stop.signum

    @property
    def samples(self) -> int:
        """Samples this trainer has trained on (across rejoins)."""
        return self._pos.samples

    @property
    def global_step(self) -> int:
        """The server's optimizer steps, as of this trainer's last call."""
        return self._joined("global_step").progress[0]

    @property
    def lr(self) -> float:
        """The learning rate of the server's next update (its ``--lr-schedule``), as of this
        trainer's last call."""
        session = self._joined("lr")
        lr = session.progress[1]
        return float(session.info["optimizer"]["lr"]) if lr is None else float(lr)

    @property
    def staleness(self) -> int:
        """How many other updates landed between this trainer's last read of the parameters
        and its last update (0 in sync mode)."""
        return self._joined("staleness").progress[2]

    @property
    def update_mode(self) -> str:
        """The server's ``--update``: async, sync or ssp."""
        return str(self._joined("update_mode").info["update"])

    def allreduce(self, value: float | torch.Tensor, name: str = "", op: str = "average") -> float | torch.Tensor:
        """``value`` (a number or a small tensor) reduced over the job's live trainers through the
        server, as Horovod's ``hvd.allreduce`` (``op``: ``average``, ``sum``, ``min``, ``max``):
        for metrics, as Horovod's ``metric_average``, not gradients. Every trainer of the job
        (:attr:`num_trainers`) calls it, in the same order (``name`` tells rounds apart); one
        that left meanwhile is not waited for. The result comes back as ``value`` came (a float,
        or a tensor of its dtype and device). A round that does not complete ends in a
        :class:`UsageError` after half the RPC timeout, naming who is missing."""
        session = self._joined("allreduce")
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
                return session.call("allreduce", name, sent, op, self.num_trainers)
            except RuntimeError as e:
                message = remote_message(e)
                if message.startswith("allreduce "):  # the round, not the call, failed
                    raise UsageError(f"ps.{message}") from None
                raise

        out = self._call(attempt)
        return float(out) if tensor is None else out.to(tensor.device, tensor.dtype)

    def evaluate(self, data: Dataset | Iterable, *, metric: str | Callable | None = None,
                 loss_fn: Callable | None = None, batch_size: int = 1000) -> float:
        """``metric`` (default accuracy; a name of ``psserver.utils.eval_metrics``, ``"loss"`` with
        ``loss_fn``, or a callable ``(outputs, targets) -> float``) of the replica on the
        server's current parameters, over ``data``: a ``Dataset`` of ``(input, target)`` or an
        iterable of such batches. The replica is loaded from the server first (after this
        trainer's last update landed: sync waits for its round), and left in training mode.
        The batches' outputs are concatenated as the model returns them (a tensor along dim 0, a
        tuple or dict member by member), so a model that returns a tuple or dict needs a callable
        metric: a built-in one given such outputs is a :class:`UsageError`."""
        session = self._joined("evaluate")
        if callable(metric):
            fn = metric
        else:
            loss = resolve_loss(None, "cross_entropy") if loss_fn is None else loss_fn
            _, fn = resolve_metric(metric, "accuracy", loss)
        batches = DataLoader(data, batch_size=batch_size) if isinstance(data, Dataset) else data
        self._call(session.protocol.flush)
        outputs, targets = [], []
        for x, y in batches:
            outputs.append(self._call(lambda x=x: session.protocol.evaluate(x)))
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

    # ---- leaving ---------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the server (once): what this trainer owes is handed in, the server marks it
        LEFT, and the process leaves the RPC group."""
        self._leave(None)

    def _leave(self, error: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._unhook()
        if self.session is not None:
            if error is not None and self._announce:
                log.warning("leaving psserver: the training loop raised %s: %s", type(error).__name__,
                            remote_message(error))
            report = self.session.report
            if error is None and self._stop.signum is None and report is not None:
                # The loop ran to its end: a trainer of this rank started later starts over.
                self.session.report = dataclasses.replace(report, finished=True)
            self.session.leave()
        self._stop.__exit__(None, None, None)
        atexit.unregister(self._at_exit)

    def _unhook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for hook in self._pass_hooks:
            hook.remove()
        self._pass_hooks = []

    def _at_exit(self) -> None:
        if not self._closed and self.session is not None:
            log.warning("leaving psserver at exit (use the connection as a context manager, or call close())")
        self._leave(None)

    def _joined(self, what: str) -> Session:
        if self._closed:
            raise UsageError(f"ps.{what}: this connection has left the server")
        if self.session is None:
            raise UsageError(f"ps.{what}: join first (ps.replica(model), or ps.parameter_rrefs())")
        return self.session

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        quiet = exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None))
        if isinstance(exc, RuntimeError) and "autograd context" in str(exc) and self.session is not None \
                and not self._closed:
            # The RPC tutorial's loop calls dist_autograd itself: after an eviction (the server
            # released the trainer's contexts) its backward fails there, before any call of ours.
            try:
                self._recover_from(exc)
            except ServerLost as e:  # Evicted too: the one line the user gets, not torch's frames
                raise e from None
        self._leave(None if quiet else exc)

    def _recover_from(self, error: RuntimeError) -> None:
        """An eviction or a lost server that surfaced in the user's own RPC call: ``Evicted`` or
        ``ServerLost`` (with ``reconnect``, the rejoin) instead of torch's C++ frames; nothing
        when the server says this trainer is a member (the error is the user's)."""
        assert self.session is not None
        if diagnose(self.session, error) == FAILED:
            return
        self._pos.report = asdict(self.session.report) if self.session.report is not None else None
        self._unhook()
        recover(self.session, self.config, error, self._pos, self._stop, self._run_before_rejoin, self._argv)

    def __repr__(self) -> str:
        name = self.session.name if self.session is not None else "not joined"
        return f"<psserver.Connection {self.config.server_host}:{self.config.server_port} rank {self.rank} ({name})>"


def connect(address: str | None = None, *, rank: int | None = None, num_trainers: int | None = None,
            reconnect: bool = False, token_file: str | None = None, device: str = "cpu", wire_dtype: str = "fp32",
            transport: str = "auto", overlap: str = "off", connect_timeout: float = 60.0, rpc_timeout: float = 60.0,
            step: str | None = None, handle_signals: bool = True, config: TrainerConfig | None = None) -> Connection:
    """Connect this process to the psserver at ``address`` (``HOST:PORT``) as trainer ``rank``.

    Defaults come from the environment as for ``psserver train``: ``address`` from
    ``$PSSERVER_SERVER``, else (not under torchrun, whose ``MASTER_PORT`` is its own rendezvous:
    there it is a :class:`~psserver.errors.UsageError`) ``$MASTER_ADDR:$MASTER_PORT``, else
    127.0.0.1:29500 (:func:`psserver.config.env.default_server_address`), ``rank`` from ``$RANK`` or
    ``$SLURM_PROCID`` (else 0), ``num_trainers`` (the data shards) from ``$WORLD_SIZE`` or
    ``$SLURM_NTASKS`` (else the server's sync K), the join token from ``token_file`` or
    ``$PSSERVER_JOIN_TOKEN``. ``reconnect``: when the server evicts this trainer or goes away,
    re-execute this script, which rejoins and continues (:attr:`Connection.epoch`); without it,
    :class:`~psserver.errors.Evicted` or :class:`~psserver.errors.ServerLost`. ``device``,
    ``wire_dtype`` and ``transport`` as ``psserver train``'s flags; ``overlap`` too, for
    :meth:`Connection.train_step` (off by default: a loop that runs its own backward and calls
    :meth:`Connection.step` hands in each gradient before its next forward). ``handle_signals``:
    SIGTERM and SIGINT leave after the step in flight (main thread only). ``config``: a whole ``TrainerConfig`` instead
    (``psserver train --entry`` passes its own); the other arguments are then ignored.

    Bad arguments raise :class:`~psserver.errors.UsageError`. Nothing is sent before
    :meth:`Connection.replica` (or :meth:`Connection.parameter_rrefs`), which joins."""
    if config is not None and not isinstance(config, TrainerConfig):
        raise UsageError(f"psserver.connect: config is a psserver.config.TrainerConfig, not {type(config).__name__}")
    if config is None:
        if not isinstance(handle_signals, bool):
            raise UsageError(f"psserver.connect: handle_signals is True or False, not {handle_signals!r}")
        config = _config(address, rank=rank, num_trainers=num_trainers, reconnect=reconnect, token_file=token_file,
                         device=device, wire_dtype=wire_dtype, transport=transport, overlap=overlap,
                         connect_timeout=connect_timeout, rpc_timeout=rpc_timeout, step=step)
    return Connection(config, handle_signals=handle_signals)


def _config(address: str | None, **kw: Any) -> TrainerConfig:
    if address is not None and not isinstance(address, str):
        raise UsageError(f"psserver.connect: address is 'HOST:PORT', a str, not {type(address).__name__}")
    if address is not None and not address.strip():
        raise UsageError("psserver.connect: address '' names no server (None takes the default)")
    if not isinstance(kw.get("reconnect", False), bool):
        raise UsageError(f"psserver.connect: reconnect is True or False, not {kw['reconnect']!r}")
    for name in ("device", "wire_dtype", "transport", "overlap"):
        if name in kw and not isinstance(kw[name], str):
            raise UsageError(f"psserver.connect: {name} is a str, not {type(kw[name]).__name__}")
    if kw.get("token_file") is not None and not isinstance(kw["token_file"], str | os.PathLike):
        raise UsageError(f"psserver.connect: token_file is a path, not {type(kw['token_file']).__name__}")
    try:
        host, port = parse_host_port(address or default_server_address(option="psserver.connect('HOST:PORT')"),
                                     default_port=29500)
    except ValueError as e:
        raise UsageError(f"psserver.connect: {e}") from None
    rank = kw.pop("rank")
    num_trainers = kw.pop("num_trainers")
    token_file = kw.pop("token_file")
    step = kw.pop("step")
    try:
        return TrainerConfig(rank=rank if rank is not None else (default_rank() or 0), server_host=host,
                             server_port=port, num_trainers=num_trainers if num_trainers is not None
                             else default_world_size(), join_token_file=Path(token_file) if token_file else None,
                             step=step, progress=False, **kw)
    except (ValueError, TypeError) as e:  # TypeError: a comparison of a value of the wrong type
        raise UsageError(f"psserver.connect: {e}") from None
