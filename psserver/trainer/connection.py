"""This process's membership of a parameter server, whichever way it steps: a
:class:`Connection`, made by ``psserver.connect`` (``psserver.trainer.library``). Its three
ways to step are objects of their own: ``psserver.trainer.replica``, ``remote_model`` and
``model_steps``; where it is in its run, ``psserver.trainer.ledger``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import signal
from collections.abc import Callable, Iterable
from dataclasses import asdict
from types import TracebackType
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.data import Dataset

from psserver.common.messages import Report
from psserver.config import OptimizerConfig, TrainerConfig
from psserver.errors import ServerLost, UsageError
from psserver.trainer import measure
from psserver.trainer.ledger import Ledger
from psserver.trainer.local_sgd import LocalSGD
from psserver.trainer.model_steps import ModelSteps
from psserver.trainer.recovery import FAILED, diagnose, join, recover, shard_count
from psserver.trainer.rejoin import Position, save_owed, script_command_line, take_owed, take_position
from psserver.trainer.remote_model import RemoteModel, remote_config
from psserver.trainer.replica import Replica, replica_config, table_names
from psserver.trainer.sampler import ResumableSampler
from psserver.trainer.session import Session, remote_message
from psserver.trainer.stop_signals import StopSignals
from psserver.utils.memory import configure_host_allocator

log = logging.getLogger(__name__)


class Connection:
    """This process's membership of a psserver job, whichever way it steps.

    Made by :func:`psserver.connect`; use it as a context manager, which leaves the server on
    the way out (after an exception too, saying so). It keeps the join and the leave, the
    heartbeat (``psserver.trainer.session``), SIGTERM and SIGINT left at the step boundary, the
    position and :meth:`sampler`, what the server says, :meth:`evaluate`, :meth:`allreduce`, and
    a failed call diagnosed by asking the server: with ``reconnect=True`` a trainer evicted, or
    that lost its server, re-executes its own script (RPC cannot be set up twice in one
    process), which continues from :attr:`epoch`.

    It joins one of three ways, each an object of its own (:attr:`stepping`) that its names
    here delegate to, refusing a call of another way: :meth:`replica` makes a
    :class:`~psserver.trainer.replica.Replica` (a loop of your own: :meth:`step`, :meth:`sync`,
    :meth:`local_sgd`, :attr:`local_steps`, :meth:`rows`), :meth:`parameter_rrefs` a
    :class:`~psserver.trainer.remote_model.RemoteModel` (PyTorch's RPC tutorial loop:
    :meth:`forward`), :meth:`join` returns :class:`~psserver.trainer.model_steps.ModelSteps`
    (``psserver train``'s loop: :meth:`train_step`).
    """

    def __init__(self, config: TrainerConfig, *, handle_signals: bool = True, announce_errors: bool = True,
                 rejoin_command: Callable[[], list[str] | None] = script_command_line,
                 retry_first_join: bool = True) -> None:
        """``announce_errors``: log that the connection leaves because of an exception (False: a
        command reports it). ``rejoin_command``: the command line a rejoin re-executes (this
        script's; ``psserver train``'s, None when the CLI runs in-process: never re-executed).
        ``retry_first_join``: a first join whose ``init_rpc`` failed as the RPC group changed under
        it (two trainers starting together, or one leaving: "EOF") runs this command line again,
        at most 3 times, without ``reconnect`` too: nothing was trained yet, and the alternative is
        a script that fails at random when its job starts."""
        self.config = config
        self._announce = announce_errors
        configure_host_allocator(config.allocator)
        resumed = take_position()
        self.resumed = resumed is not None and not resumed.first_join_tries
        """Whether this process continues a trainer that rejoined (``reconnect=True``)."""
        self._ledger = Ledger(resumed)
        self._pos = self._ledger.pos
        self._argv = rejoin_command()
        self._retry_first_join = retry_first_join
        self._stop = StopSignals()
        if handle_signals:
            self._stop.__enter__()
        self.session: Session | None = None
        """The membership once joined (``psserver.trainer.session``): the connection's own."""
        self._path: Replica | RemoteModel | ModelSteps | None = None  # how it steps (:attr:`stepping`)
        self._rejoin_hooks: list[Callable[[], None]] = []
        self.steps_per_epoch: int | None = None
        """Set by a loop that knows it (``psserver train``'s): a step made again after a lost server
        may then be the last of the epoch before."""
        self._closed = False
        self._builds = True  # a model of the server's that is code is built here (ps.parameter_rrefs: never)
        atexit.register(self._at_exit)

    # ---- joining: the three ways to step -------------------------------------------------

    def join(self, model: nn.Module | None = None) -> ModelSteps:
        """Join the server with ``model``, or with the model of the connection's config (its
        ``--model``, else the server's), for ``psserver train``'s own loop: the
        :class:`~psserver.trainer.model_steps.ModelSteps` returned steps it a batch at a time
        (:meth:`train_step`). A loop of your own joins with :meth:`replica` instead, the RPC
        tutorial's with :meth:`parameter_rrefs`."""
        self._path = ModelSteps(self, self._join_session(model))
        return self._path

    def replica(self, model: nn.Module, *, optimizer: torch.optim.Optimizer | OptimizerConfig | None = None
                ) -> nn.Module:
        """Join the server with ``model`` (an ``nn.Module``, or one made by ``torch.compile``) and
        return it, on the connection's ``device``, holding the server's parameters and buffers;
        ``optimizer``: the one the server should run (a ``torch.optim`` optimizer over
        ``model.parameters()``, or an ``OptimizerConfig``). The connection then steps through a
        :class:`~psserver.trainer.replica.Replica` (:attr:`stepping`; its docstring says the rest)."""
        self.config = replica_config(self.config, optimizer)
        inner = getattr(model, "_orig_mod", None) if isinstance(model, nn.Module) else None
        compiled = model if isinstance(inner, nn.Module) else None
        session = self._join_session(inner if compiled is not None else model)
        self._path = Replica(self, session, compiled)
        try:
            self._path.open()
        except BaseException:
            self._leave(None)
            raise
        return self._path.model

    def parameter_rrefs(self) -> list[torch.distributed.rpc.RRef]:
        """RRefs to the server's parameters, for PyTorch's RPC tutorial loop: joins with ``step='plain'``
        (:meth:`~psserver.trainer.remote_model.RemoteModel.parameter_rrefs`)."""
        if self.session is None:
            self.config = remote_config(self.config)
            self._builds = False  # the server runs the model: this trainer builds none of its code
            self._join_session(None)
        return self._remote("parameter_rrefs").parameter_rrefs()

    def forward(self, x: Any) -> torch.Tensor:
        """The server's model on ``x`` (:meth:`~psserver.trainer.remote_model.RemoteModel.forward`)."""
        return self._remote("forward").forward(x)

    def train_step(self, x: Any, y: Any, *, samples: int,
                   on_failure: Callable[[Exception], None] | None = None) -> float:
        """``psserver train``'s step on ``(x, y)`` (:meth:`~psserver.trainer.model_steps.ModelSteps.train_step`)."""
        return self._model_steps("train_step").train_step(x, y, samples=samples, on_failure=on_failure)

    def step(self, *, samples: int | None = None, loss: float | torch.Tensor | None = None) -> None:
        """One update: the gradient up, the server's values back in (:meth:`~psserver.trainer.replica.Replica.step`)."""
        self._replica("step").step(samples=samples, loss=loss)

    def sync(self, *, samples: int | None = None, loss: float | torch.Tensor | None = None) -> int:
        """DiLoCo: hand in this window (:meth:`~psserver.trainer.replica.Replica.sync`)."""
        return self._replica("sync").sync(samples=samples, loss=loss)

    def local_sgd(self, optimizer: torch.optim.Optimizer, *, every: int | None = None) -> LocalSGD:
        """DiLoCo: a sync every ``every`` inner steps (:meth:`~psserver.trainer.replica.Replica.local_sgd`)."""
        return self._replica("local_sgd").local_sgd(optimizer, every=every)

    @property
    def local_steps(self) -> int:
        """Inner steps of this window (DiLoCo's H; the server's, with ``--dynamic-local-steps``)."""
        return self._replica("local_steps").local_steps

    def rows(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """A batch's embedding rows, a tensor per table (:meth:`~psserver.trainer.replica.Replica.rows`)."""
        return self._replica("rows", "feeds").rows(ids)

    @property
    def tables(self) -> list[str]:
        """The embedding tables on the servers, in the order of the ids' columns (empty: none)."""
        return table_names(self._joined("tables").info)

    @property
    def stepping(self) -> Replica | RemoteModel | ModelSteps | None:
        """How this connection steps once it joined: its ``Replica``, ``RemoteModel`` or
        ``ModelSteps`` (None before)."""
        return self._path

    @property
    def model(self) -> nn.Module | None:
        """The replica :meth:`replica` returned (None before, and on the other ways to step)."""
        return self._path.model if isinstance(self._path, Replica) else None

    def _join_session(self, model: nn.Module | None) -> Session:
        if self.session is not None:
            raise UsageError("this connection has joined already: one replica per connection (and per process)")
        if self._closed:
            raise UsageError("this connection has left the server")
        if model is not None and not isinstance(model, nn.Module):
            raise UsageError(f"ps.replica takes an nn.Module, got {type(model).__name__}")
        self.session = self._join(model)
        return self.session

    def _join(self, model: nn.Module | None) -> Session:  # a test's stand-in session replaces it
        again = self.resumed or self._pos.first_join_tries or self._pos.fell_back  # a position to continue from
        session = join(self.config, self._pos if again else None, self._stop,
                       model, self._argv, build=self._builds, retry_first_join=self._retry_first_join)
        if self._pos.report is not None:
            session.report = Report(**self._pos.report)
        if session.continued is not None:
            self._ledger.continue_from(session.continued, self.config.rank)
            self.resumed = True
        if self._pos.owed_window is not None:  # what the last image's failed call carried: sent again
            self.session = session
            owed, self._pos.owed_window = take_owed(self._pos.owed_window), None
            if owed is not None:  # (failing again, it is saved again for the next image)
                self._call(lambda: session.protocol.send_again(owed))
        return session

    # ---- training --------------------------------------------------------------------------

    def sampler(self, dataset: Dataset, *, shuffle: bool = True, seed: int = 0,
                drop_last: bool = False) -> ResumableSampler:
        """This trainer's shard of ``dataset``: a ``DistributedSampler`` over ``num_trainers``
        shards at this rank (call its ``set_epoch`` each epoch), which after a rejoin resumes
        the epoch it was in without the samples already trained on. Before the join (on any
        rank) the shard count must come from ``num_trainers`` or ``$WORLD_SIZE``: the server's
        sync K is known only from its answer to the join."""
        return self._ledger.sampler(dataset, num_replicas=self.num_trainers, rank=self.config.rank, shuffle=shuffle,
                                    seed=seed, drop_last=drop_last)

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
        """A step done (of any way to step), in the position and the report the server is told."""
        assert self.session is not None
        self.session.report = self._ledger.count(samples, loss, self.steps_per_epoch)

    def _check_count(self) -> None:
        self._ledger.check_count()

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
                self._ledger.roll_back(owed, self.steps_per_epoch)
            window = getattr(self.session.protocol, "owed_window", lambda: None)()
            if window is not None and self._pos.owed_window is None:
                self._pos.owed_window = save_owed(window)
            self._recover(e)

    def _recover(self, error: BaseException) -> NoReturn:
        """Hand the position to the rejoin (or end: evicted, lost), after a failed call."""
        assert self.session is not None
        self._pos.report = asdict(self.session.report) if self.session.report is not None else None
        self._unhook()
        recover(self.session, self.config, error, self._pos, self._stop, self._run_before_rejoin, self._argv)

    def before_rejoin(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` before this process re-executes itself to rejoin (``reconnect=True``):
        close what would outlive the process image, such as a DataLoader's worker processes."""
        self._rejoin_hooks.append(fn)

    def _run_before_rejoin(self) -> None:
        for fn in self._rejoin_hooks:
            fn()

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
        """``value`` (a metric: a number or a small tensor) averaged, summed, min'ed or max'ed over
        the job's live trainers through the server (:func:`~psserver.trainer.measure.allreduce`)."""
        return measure.allreduce(self._call, self._joined("allreduce"), value, name, op, self.num_trainers)

    def evaluate(self, data: Dataset | Iterable, *, metric: str | Callable | None = None,
                 loss_fn: Callable | None = None, batch_size: int = 1000) -> float:
        """``metric`` (default accuracy) of the model on the server's current parameters over
        ``data`` (:func:`~psserver.trainer.measure.evaluate`)."""
        return measure.evaluate(self._call, self._joined("evaluate").protocol, data, metric, loss_fn, batch_size)

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
        if isinstance(self._path, Replica):
            self._path.unhook()

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

    def _replica(self, what: str, does: str = "trains") -> Replica:
        """The replica this connection steps, for ``ps.{what}``; refused on the other ways."""
        self._joined(what)
        if not isinstance(self._path, Replica):
            raise UsageError(f"ps.{what} {does} a replica: call ps.replica(model) first")
        return self._path

    def _remote(self, what: str) -> RemoteModel:
        """The server's model, for ``ps.{what}`` (made here for a session joined with step='plain')."""
        session = self._joined(what)
        if session.step_protocol != "plain" and what == "forward":
            raise UsageError("ps.forward is the RPC tutorial's path: call ps.parameter_rrefs() first (no ps.replica)")
        if session.step_protocol != "plain":
            raise UsageError(f"ps.parameter_rrefs needs step='plain'; this connection trains with "
                             f"{session.step_protocol!r} (ps.replica)")
        self._path = self._path or RemoteModel(self, session)
        if not isinstance(self._path, RemoteModel):
            raise UsageError(f"ps.{what} is the RPC tutorial's path; this connection steps with ps.train_step")
        return self._path

    def _model_steps(self, what: str) -> ModelSteps:
        """``psserver train``'s steps, for ``ps.{what}``; refused on the other ways."""
        self._joined(what)
        if not isinstance(self._path, ModelSteps):
            raise UsageError(f"ps.{what} is psserver train's loop (ps.join()); this connection steps with "
                             f"{'ps.step (ps.replica)' if isinstance(self._path, Replica) else 'ps.forward'}")
        return self._path

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
        if diagnose(self.session, error) != FAILED:
            self._recover(error)

    def __repr__(self) -> str:
        name = self.session.name if self.session is not None else "not joined"
        return f"<psserver.Connection {self.config.server_host}:{self.config.server_port} rank {self.rank} ({name})>"

