"""The handler behind the server's RPC surface (``psserver.common.calls``, whose functions
forward to the one :class:`Endpoint` a server process installs). The endpoint is thin: it
counts the call in flight (a draining server waits for them), touches membership and records
the trainer's :class:`Report`, then dispatches to the server half of the trainer's step
protocol. It does no tensor work.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from psserver import __version__
from psserver.common import torch_rpc
from psserver.common.calls import NOT_A_MEMBER, Progress
from psserver.common.messages import JoinRequest, Report
from psserver.config import OptimizerConfig, ServerConfig
from psserver.config.ps import COMPUTE_MODES, STEP_MODES, default_step
from psserver.errors import JoinLater
from psserver.exporters import observe_rpc
from psserver.models.layout import ModelLayout
from psserver.server.averages import Averages
from psserver.server.engine.held_model import check_values, layout_bytes

if TYPE_CHECKING:
    from psserver.server.engine.engine import StepEngine
    from psserver.server.group.server_group import ServerGroup
    from psserver.server.membership import Member, Membership
    from psserver.server.steps import ServerHalf

log = logging.getLogger(__name__)


class NotAMember(RuntimeError):
    """A call from a trainer that is not a member (evicted, or never joined).

    It reaches the trainer as a bare ``RuntimeError`` (torch 2.14 keeps a remote exception's
    text, not its type): a trainer whose call failed asks :func:`heartbeat`, whose answer says
    it (``NOT_A_MEMBER``).
    """

    log_level = logging.INFO
    """An evicted trainer's next call meets it: routine, not a warning (``calls._refused_quietly``)."""


class Endpoint:
    """Admits trainers and dispatches their calls; ``state`` gates joins."""

    def __init__(self, config: ServerConfig, engine: StepEngine, halves: dict[str, ServerHalf],
                 after_call: Callable[[], None]) -> None:
        self.config = config
        self.engine = engine
        self.halves = halves
        self.after_call = after_call
        """Run after each call, outside every lock (a checkpoint the call's step made due)."""
        self.membership: Membership | None = None
        self.group: ServerGroup | None = None
        """Server 0 of several server processes: the others (``psserver.server.group.server_group``)."""
        self.state = "STARTING"
        self.on_model: Callable[[], None] = lambda: None
        """Called once the server holds a model it learnt from a trainer (it publishes it)."""
        self._model_lock = threading.Lock()
        # Metric labels: only names a protocol defines, never a caller's arbitrary string.
        self.averages = Averages()
        """``ps.allreduce`` of the trainers (metrics averaged through this server)."""
        self._ops = {"evaluate", "allreduce"} | {op for h in halves.values() for op in (*h.ops, *h.local_ops)}
        self._in_flight = 0
        self._idle = threading.Condition()
        self._ranks_seen: set[int] = set()
        """Ranks that have joined this server (``ps.allreduce`` waits only for ranks still to come)."""
        self._stopped_at: dict[int, dict[str, int]] = {}
        """rank -> where its last trainer stopped, when it left (or was lost) before its loop's end."""

    def open(self, membership: Membership) -> None:
        self.membership = membership
        self.state = "SERVING"

    def drain(self) -> None:
        self.state = "DRAINING"

    @contextmanager
    def _counted(self, method: str) -> Iterator[None]:
        with self._idle:
            self._in_flight += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            observe_rpc(method, time.perf_counter() - t0)
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def _joining(self, name: str) -> AbstractContextManager:
        return self.membership.joining(name) if self.membership is not None else nullcontext()

    def wait_idle(self, timeout: float) -> int:
        """Wait until no call is in flight (at most ``timeout`` s); the calls still running."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout)
            return self._in_flight

    # ---- calls ------------------------------------------------------------------------------

    def join(self, request: JoinRequest) -> dict[str, Any]:
        """Admit a trainer; a refusal is returned as ``{"error": ...}`` (the user's mistake,
        not a server fault: no traceback in the server's log). A request no psserver trainer
        sends is refused before any of it is used."""
        why = request.malformed() if isinstance(request, JoinRequest) else f"it is a {type(request).__name__}"
        if why is not None:
            log.warning("refused a malformed join request: %s", why)
            return {"error": f"malformed join request: {why}", "retry": False}
        with self._counted("join"), self._joining(request.name):
            try:
                return self._admit(request)
            except (ValueError, RuntimeError, TypeError, KeyError, AttributeError) as e:
                # TypeError & co: values inside the request's dicts and lists no trainer sends.
                what = str(e) if isinstance(e, ValueError | RuntimeError) else f"malformed join request ({e!r})"
                log.warning("refused %s (rank %d from %s): %s", request.name, request.rank, request.host, what)
                return {"error": what, "retry": isinstance(e, JoinLater)}

    def _admit(self, request: JoinRequest) -> dict[str, Any]:
        if self.state != "SERVING" or self.membership is None:
            raise JoinLater(f"psserver is {self.state.lower()}: not accepting trainers")
        step = self._protocol_of(request)
        half = self.halves[step]
        cfg = self.config
        # What can refuse the join without changing the server, before the model is taken.
        requested = OptimizerConfig(**request.optimizer) if request.optimizer else None
        refusal = self.engine.optimizer_refusal(requested)
        if refusal is not None:
            raise ValueError(refusal)
        half.check_join(request)
        if self.membership.is_member(request.name):  # each join takes a fresh name: this one is another's
            raise ValueError(f"{request.name} is a member already")
        self._accept_model(request, step)
        optimizer = self.engine.agree_optimizer(requested, request.name)
        join_info = half.join_info(request.name, request)
        try:
            self.membership.join(request.rank, request.name, request.host, step, join_info.get("transport"))
        except BaseException:
            half.trainer_gone(request.name, False)  # what join_info set up for it
            raise
        if self.group is not None:
            try:
                self.group.trainer_joined(request, step)
            except RuntimeError:
                self.membership.leave(request.name)
                raise
            join_info = {**join_info, **self.group.join_info()}
        self.engine.trainer_joined(request.name)
        self._ranks_seen.add(request.rank)
        # The trainer heartbeats once it has this answer: the other server processes' part of
        # the join (their first optimizer, say) must not count against its --trainer-timeout.
        # Evicted meanwhile: a refusal (NotAMember), not a KeyError raised into torch's RPC.
        self._seen(request.name, None)
        return {
            "step": step,
            "compute": STEP_MODES[step].compute,
            "model": self.engine.model_ref,
            "model_args": self.engine.model_args,
            "fingerprint": self.engine.layout.fingerprint() if self.engine.layout is not None else None,
            "update": cfg.update,
            "outer": cfg.outer if cfg.update == "diloco" else None,
            "sync_trainers": cfg.sync_trainers,
            "optimizer": asdict(optimizer),
            "global_step": self.engine.global_step,
            # A fresh trainer of a rank whose last one stopped unfinished continues from there.
            "position": self._stopped_at.get(request.rank) if request.steps == 0 else None,
            "heartbeat_interval": max(0.1, cfg.trainer_timeout / 5),
            "version": __version__,
            **join_info,
        }

    def _accept_model(self, request: JoinRequest, step: str) -> None:
        """Check the trainer's model against the server's; a server that holds none yet takes
        it, with its initial values (``ValueError``: a model that differs, or no values). A
        trainer whose every forward runs here may bring none (the RPC tutorial's path)."""
        if request.layout is None:
            if self.engine.has_model and STEP_MODES[step].compute == "server":
                return
            raise ValueError("this trainer sent no model layout (a psserver older than this server?)")
        if request.model is not None and not (isinstance(request.model, str) and 0 < len(request.model) <= 200
                                              and request.model.isprintable()):
            raise ValueError("this trainer names its model with something other than a line of at most 200 "
                             "printable characters")
        layout = ModelLayout.from_dict(request.layout)
        with self._model_lock:  # two first trainers: one brings the model, the other is checked against it
            if self.engine.has_model:
                self.engine.check_layout(layout, f"trainer {request.rank}'s model ({request.model})")
                return
            if request.values is None:
                raise ValueError("the server has no model yet and this trainer sent none: join again")
            size = layout_bytes(layout)
            if size > self.config.max_model_bytes:
                raise ValueError(f"this trainer's model is {size:,} bytes, over the server's --max-model-bytes "
                                 f"{self.config.max_model_bytes:,}: start psserver serve with a larger one (or "
                                 "--model) to hold it")
            values = list(request.values)
            check_values(layout, values)
            if self.group is not None:  # the other server processes get their pieces first
                self.group.give_model(layout, values, request.model, request.model_args or {})
            self.engine.adopt(layout, values, request.model, request.model_args or {})
        self.on_model()

    def _protocol_of(self, request: JoinRequest) -> str:
        """The step protocol a joining trainer will speak (``ValueError``: one it may not)."""
        pin = self.config.compute
        diloco = self.config.update == "diloco"
        if request.step is None:
            step = "diloco" if diloco and request.compute in (None, "trainer") else \
                default_step(request.compute or pin or next(iter(COMPUTE_MODES)))
        else:
            step = request.step
        if diloco != (step == "diloco"):
            raise ValueError("this server runs --update diloco: its trainers take local steps (--step diloco, "
                             f"psserver train --local-steps H); the trainer asked for --step {step}" if diloco else
                             f"--step diloco needs a server started with --update diloco (this one runs "
                             f"--update {self.config.update})")
        if step not in self.halves:
            raise ValueError(f"this server does not speak --step {step!r} (it speaks {', '.join(sorted(self.halves))})")
        if self.engine.tables is not None and step not in ("pushpull", "pull"):
            raise ValueError(f"model {self.config.model} keeps embedding tables on the servers: its rows and their "
                             f"gradients travel with --step pushpull or pull; the trainer asked for --step {step}")
        if self.group is not None and step not in ("pushpull", "diloco"):
            raise ValueError(f"with --num-servers {self.config.num_servers} trainers speak --step pushpull (one "
                             f"exchange per server process per step); the trainer asked for --step {step}")
        compute = STEP_MODES[step].compute
        if compute == "server" and self.engine.spec is None:
            raise ValueError("this server was started without --model: it holds the model's tensors, not its code, so "
                             f"trainers compute (--compute trainer); the trainer asked for --step {step}")
        if pin is not None and compute != pin:
            raise ValueError(f"this server runs every step with --compute {pin}; the trainer asked for "
                             f"--compute {compute} (--step {step}): drop the flag or pass --compute {pin}")
        if compute == "server" and (request.wire_dtype != "fp32" or request.device != "cpu"):
            raise ValueError(f"--wire-dtype {request.wire_dtype} and --device {request.device} apply to trainer "
                             f"compute; this trainer would speak --step {step} (server compute)")
        return step

    def call(self, trainer: str, op: str, args: tuple, report: Report | None) -> tuple[Any, list[str], Progress]:
        """``op`` of the server half of ``trainer``'s protocol (or ``evaluate``): its result, what
        the trainer should be told (a step the guard dropped; its eviction) and where the server
        is after the call (:data:`Progress`: what the library shows its user)."""
        with self._counted(op if op in self._ops else "unknown"):
            member = self._seen(trainer, None)
            if self.state == "WAITING":
                raise RuntimeError(f"psserver is waiting for server process(es) {self._missing()}: no steps until "
                                   "they are back")
            try:
                half = self.halves[member.protocol]
                if op == "allreduce":
                    result = self.averages.reduce(trainer, *args, live=self.membership.names,  # type: ignore[union-attr]
                                                  timeout=self.config.rpc_timeout / 2,
                                                  ranks_seen=lambda: len(self._ranks_seen))
                elif op != "evaluate" and op not in half.ops:
                    raise ValueError(f"step protocol {member.protocol!r} has no call {op!r}")
                else:
                    result = getattr(half, op)(trainer, *args)
                # After the call, and only when it did its work: a step the report counts may be
                # applied by this very call (a DiLoCo window's sync), and neither status nor a
                # trainer started again from this position may count it before it is.
                _record(member, report)
            finally:
                self._unless_member(member)
            self.after_call()
            notices = self._guard_notices(trainer)
        return result, notices, self._progress(trainer)

    def _progress(self, trainer: str) -> Progress:
        mine = self.engine.trainer_progress(trainer)
        return self.engine.global_step, self.engine.learning_rate, mine.staleness if mine is not None else 0

    def _unless_member(self, member: Member) -> None:
        """A call that waited (sync, ssp) while its trainer was evicted may have opened a step
        after the eviction cleaned up: drop what it left, or a drain would wait for it."""
        assert self.membership is not None
        name = member.status.name
        if not self.membership.is_member(name):
            self.halves[member.protocol].trainer_gone(name, True)
            self.engine.trainer_gone(name)

    def _guard_notices(self, trainer: str) -> list[str]:
        """The guard's notices for ``trainer``; past ``--max-nonfinite-steps`` it is evicted,
        after this reply (its next call learns it is no longer a member)."""
        guard = self.engine.guard
        notices = guard.take_notices(trainer)
        reason = guard.must_evict(trainer)
        if reason is not None and self.membership is not None:
            notices.append(f"evicted by the server: {reason}")
            threading.Thread(target=self.membership.evict, args=(trainer, reason), name="psserver-evict",
                             daemon=True).start()
        return notices

    def _missing(self) -> str:
        return ", ".join(map(str, self.group.missing())) if self.group is not None else "?"

    def call_local(self, trainer: str, op: str, *args: Any) -> Any:
        """An op that runs inside the server on the trainer's behalf (see ``ServerHalf.local_ops``)."""
        with self._counted(op if op in self._ops else "unknown"):
            member = self._seen(trainer, None)
            half = self.halves[member.protocol]
            if op not in half.local_ops:
                raise ValueError(f"step protocol {member.protocol!r} has no local call {op!r}")
            result = getattr(half, op)(trainer, *args)
            self.after_call()
        return result

    def heartbeat(self, trainer: str, report: Report | None) -> str:
        """The server's state, or ``NOT_A_MEMBER``: an answer, not an error, so that a trainer
        learns of its eviction from a value rather than from the text of a remote exception."""
        try:
            self._seen(trainer, report)
        except NotAMember:
            return NOT_A_MEMBER
        return self.state

    def host_trainers(self, trainer: str) -> int:
        """Live trainers on ``trainer``'s host, itself included (it takes its share of the
        host's CPUs); 1 for a trainer that is not a member."""
        try:
            member = self._seen(trainer, None)
        except NotAMember:
            return 1
        assert self.membership is not None
        return max(1, self.membership.on_host(member.status.host))

    def leave(self, trainer: str, report: Report | None) -> None:
        with self._counted("leave"):
            try:
                self._seen(trainer, report)
            except NotAMember:
                return  # evicted meanwhile: gone already
            assert self.membership is not None
            self.membership.leave(trainer)

    def trainer_of_context(self, context_id: int) -> str:
        """The member whose RPC worker created dist_autograd context ``context_id`` (torch
        puts the worker's id in its top 16 bits); ``NotAMember`` when none is."""
        if self.membership is None:
            raise RuntimeError(f"psserver is {self.state.lower()}")
        worker = torch_rpc.context_worker(context_id)
        for name in self.membership.names():
            if torch_rpc.worker_id(name) == worker:
                return name
        raise NotAMember(f"autograd context {context_id} is not a member's: rejoin")

    def _seen(self, trainer: str, report: Report | None) -> Member:
        if self.membership is None:
            raise RuntimeError(f"psserver is {self.state.lower()}")
        try:
            member = self.membership.seen(trainer)
        except KeyError:
            raise NotAMember(f"{trainer} is not a member of this psserver (evicted or never joined)") from None
        _record(member, report)
        return member

    def trainer_gone(self, member: Member, state: str, evicted: bool) -> None:
        """Membership's callback: the trainer's open step and protocol state go, whole."""
        name = member.status.name
        self.averages.trainer_gone(name)
        position = stopped_at(member.report)
        if position is None:
            self._stopped_at.pop(member.status.rank, None)
        else:
            self._stopped_at[member.status.rank] = position
        self.halves[member.protocol].trainer_gone(name, evicted)
        self.engine.trainer_gone(name)  # may apply a sync round it held up
        if self.group is not None:
            self.group.trainer_gone(name)
        self.after_call()


def stopped_at(report: Report | None) -> dict[str, int] | None:
    """Where a trainer that left stopped in its data (None: it finished, never stepped, or its
    report does not say: its successor starts over)."""
    if report is None or report.finished is not False:
        return None
    fields = ("epoch", "epoch_samples", "batch_idx", "steps", "samples")
    values = [getattr(report, f) for f in fields]
    if not all(type(v) is int and 0 <= v < 2 ** 53 for v in values) or report.steps == 0:
        return None
    return dict(zip(fields, values, strict=True))


def _record(member: Member, report: Report | None) -> None:
    if report is None:
        return
    member.report = report
    st = member.status
    st.steps, st.samples = int(report.steps), int(report.samples)
    st.last_loss, st.samples_per_s = float(report.loss), float(report.samples_per_s)
    if report.accuracy is not None and math.isfinite(report.accuracy):
        st.accuracy = float(report.accuracy)
