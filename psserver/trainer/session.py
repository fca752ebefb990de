"""A trainer's session with the parameter server: one membership of its RPC group.

The :class:`Session` is the join, the heartbeat, the leave, and the channel its step
protocol's trainer half calls the server through (``psserver.trainer.steps``). Progress and
liveness ride on every call as a :class:`~psserver.common.messages.Report`; a low-rate heartbeat
covers the time between steps. The training loop around it: ``psserver.trainer.loop``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
import time
from dataclasses import asdict

import torch
import torch.distributed.rpc as rpc

from psserver.common import calls, rendezvous, torch_rpc, transport
from psserver.common.devices import resolve_device
from psserver.common.messages import JoinRequest, Report
from psserver.common.transport import WIRE_DTYPES
from psserver.config import TrainerConfig
from psserver.errors import DeviceMapFailed, ServerUnavailable, UsageError
from psserver.models import ModelSpec, build_model, get_model_spec
from psserver.models.layout import ModelLayout, values_of
from psserver.models.losses import resolve_loss
from psserver.models.registry import model_bytes
from psserver.trainer.steps import TrainerHalf, trainer_half
from psserver.trainer.stop_signals import StopSignals
from psserver.utils.cpp_log import quiet_cpp_warnings
from psserver.utils.memory import available_memory
from psserver.utils.references import is_reference

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0
EVICTION_NOTICE = "evicted by the server: "
"""How the server's notice of an eviction starts (``psserver.server.endpoint``), its reason after."""
"""How long a trainer whose call failed waits for the server to say whether it is a member."""


class JoinLost(ServerUnavailable):
    """``init_rpc`` failed: the server or a member went away while this trainer joined."""


class JoinDeferred(JoinLost):
    """The server refused the join for now (``JoinLater`` there: it is starting, waits for a
    missing server process, drains): ``--reconnect`` tries again, in a fresh process as after
    a lost join (this one's RPC is spent)."""


class PartitionCallError(RuntimeError):
    """A call to one of several server processes failed (``Session.call_each``)."""

    def __init__(self, server: int, name: str, message: str) -> None:
        super().__init__(message)
        self.server = server
        self.server_name = name


class EachCall:
    """The calls of :meth:`Session.call_each_async`, one per server process, in flight."""

    def __init__(self, session: Session, futures: list) -> None:
        self.session, self.futures = session, futures

    def wait(self) -> list:
        """Their results, server 0's first; ``PartitionCallError`` naming the first that failed
        (once every call has answered). Server 0's notices and progress are the session's."""
        results, failed = [], None
        for i, fut in enumerate(self.futures):
            try:
                result, notices, progress = fut.wait()
            except RuntimeError as e:
                failed = failed or (i, e)
                continue
            if i == 0:
                self.session.progress = progress
                self.session._told(notices)
            results.append(result)
        if failed is not None:
            i, e = failed
            name = self.session.servers[i]
            raise PartitionCallError(i, name, f"server {i} ({name}): {remote_message(e)}")
        return results


def join_rpc_group(name: str, rpc_id: int, options: object, server: str) -> None:
    """This process into the server's RPC group (``JoinLost``: the group or the server went away
    meanwhile; ``UsageError``: the agents' devices do not fit, e.g. a server whose device map
    sends CUDA tensors to a trainer whose torch has no CUDA, which torch says as a ValueError)."""
    try:
        rpc.init_rpc(name, rank=rpc_id, world_size=None, rpc_backend_options=options)
    except RuntimeError as e:
        raise JoinLost(f"cannot join the RPC group of {server}: {str(e).splitlines()[0]}") from None
    except ValueError as e:
        raise UsageError(f"cannot join the RPC group of {server}: the devices of its RPC agents do not fit this "
                         f"trainer's ({str(e).splitlines()[0]})") from None


class Session:
    """One membership of the RPC group, at most one per process (``--reconnect`` re-executes the
    trainer to rejoin: see the module's docstring)."""

    def __init__(self, config: TrainerConfig, stop: StopSignals | None = None,
                 model: torch.nn.Module | None = None, steps: int = 0, build: bool = True,
                 fell_back: str | None = None) -> None:
        """``build``: False when this trainer runs no model (the RPC tutorial's path, whose forward
        runs on the server): a server's model that is code is then not built here. ``fell_back``:
        why the device map this rank's last process image joined with failed (``DeviceMapFailed``):
        this one goes ``staged`` instead."""
        self.config = config
        self.fell_back = fell_back
        self.steps_before = steps
        """Steps this rank trained before this join (its position; 0 for a fresh trainer)."""
        self.bucket_cap_mb = config.bucket_cap_mb
        self.closed = False
        self.evicted: str | None = None
        """Why the server evicted this trainer, once it said so along with a call."""
        self.device = trainer_device(config.device)
        self.wire_dtype = WIRE_DTYPES[config.wire_dtype]
        token = rendezvous.join_token(config)
        with stop.interruptible() if stop is not None else contextlib.nullcontext():
            self.store, self.url = rendezvous.connect_store(
                config.server_host, config.server_port, config.connect_timeout, config.rpc_timeout, token
            )
        published = rendezvous.model_info(self.store)
        layout: ModelLayout | None = None
        values: list[torch.Tensor] | None = None
        if model is None and config.model is None and not build and published.get("fingerprint") is not None:
            # The RPC tutorial's path: the server holds and runs its model; this trainer builds none.
            self.spec: ModelSpec = server_model_spec(published)
            self.model: torch.nn.Module | None = None
        else:
            self.spec = choose_model(config, published) if model is None else instance_spec(model)
            """This trainer's model: the library's instance, else ``--model``, else the server's."""
            self.model = model if model is not None else build_model(
                self.spec, seed=int(published.get("seed") or 0), embedding_dim=published.get("embedding_dim"))
            """The replica (the library's instance, or as built, on the CPU): its layout is checked at the
            join; None on the RPC tutorial's path, where the server runs the model."""
            try:
                layout = ModelLayout.of(self.model)
            except ValueError as e:  # a state no server holds (a complex parameter)
                raise UsageError(f"model {self.spec.name}: {e}") from None
            # While the server holds no model, the join brings this one's initial values.
            values = values_of(self.model, layout) if published.get("fingerprint") is None else None
        self.loss_fn = resolve_loss(config.loss, self.spec.loss)
        """The training loss (``--loss``, else the model's), which the trainer half computes."""
        # Before joining the RPC group, whose join calls every member: the server evicts the
        # dead ones (this rank's crashed holder, say) or refuses a rank whose holder is alive.
        rpc_id, incarnation = rendezvous.request_admission(self.store, config.rank,
                                                           f"{config.server_host}:{config.server_port}")
        self.name = rendezvous.trainer_name(config.rank, incarnation)
        self.transport = transport.choose_path(config.transport, self.device, published, failed=fell_back)
        """How this trainer's flat buffers travel, and why (logged: a slow fallback is never silent):
        as it asks, then as the join's reply agrees; the protocol's half keeps the path from then on
        (and goes ``staged`` when a device map fails its probe)."""
        log.info("transport %s", self.transport.describe(self.device))
        rendezvous.set_transport_interface(config.server_host, local=False)
        torch_rpc.check_version()
        torch_rpc.restrict_unpickler()
        quiet_cpp_warnings()  # TensorPipe's WARNING for every peer that leaves
        join_rpc_group(self.name, rpc_id, rendezvous.backend_options(
            self.url, config.rpc_timeout, 4,
            device_maps=transport.device_maps(self.transport, self.device, rendezvous.SERVER_NAME),
            devices=[self.device] if self.transport.on_device else None), f"{config.server_host}:{config.server_port}")
        optimizer = asdict(config.optimizer) if config.optimizer else None
        request = JoinRequest(config.rank, self.name, socket.gethostname(), os.getpid(), config.step, optimizer,
                              config.compute, config.wire_dtype, str(self.device), self.spec.name, self.spec.args,
                              layout.to_dict() if layout is not None else None, values, steps,
                              transport=self.transport.kind,
                              transport_reason=self.transport.reason, overlap=config.overlap)
        t0 = time.perf_counter()
        try:
            self.info = rpc.rpc_sync(rendezvous.SERVER_NAME, calls.join, args=(request,))
        except Exception as e:  # noqa: BLE001 - the server's refusal is the user's answer
            self._shutdown(graceful=False)
            raise join_failure(e, f"{config.server_host}:{config.server_port}") from None
        if "error" in self.info:
            refusal = self.info["error"]
            self._shutdown(graceful=True)
            if self.info.get("retry"):
                raise JoinDeferred(f"the psserver at {config.server_host}:{config.server_port} refused the join for "
                                   f"now ({refusal}){'' if config.reconnect else '; --reconnect waits for it'}")
            raise UsageError(refusal)
        self.join_seconds = time.perf_counter() - t0
        """How long the join call took (with the model's initial values when it brought them)."""
        self.brought_model = values is not None
        self.report: Report | None = None
        self.progress: tuple[int, float | None, int] = (int(self.info["global_step"]), None, 0)
        """What server 0 said with its last reply: its global step, learning rate and the
        staleness of this trainer's last update."""
        self.servers: list[str] = list(self.info.get("servers", [rendezvous.SERVER_NAME]))
        """RPC names of the server processes, server 0 first (several: ``--num-servers``)."""
        agreed = self.info.get("transport")
        if agreed and agreed["kind"] != self.transport.kind:  # the server's protocol cannot use the path
            self.transport = transport.TransportPath(agreed["kind"], agreed["reason"])
            log.info("transport %s", self.transport.describe(self.device))
        self.step_protocol: str = self.info["step"]
        position = self.info.get("position")
        self.continued: dict[str, int] | None = None
        """Where this rank's last trainer stopped in its data, which this fresh one continues from
        (its gradients numbered on from there); None: it starts over."""
        if position and steps == 0:
            if config.start_over:
                log.info("rank %d starts over (--start-over): its last trainer stopped in epoch %d after %d steps",
                         config.rank, position["epoch"], position["steps"])
            else:
                self.continued = position
                self.steps_before = position["steps"]
        # Heartbeats from the answer on: the protocol's half may take seconds to set up on a
        # loaded host (plain's DistributedOptimizer imports torch.distributed.optim and calls
        # the server), which a short --trainer-timeout counts (a CI run: evicted before its first step).
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat, name="psserver-heartbeat", daemon=True)
        self._hb.start()
        try:
            self.protocol: TrainerHalf = trainer_half(self.step_protocol)(self)
        except BaseException as e:
            self._stop.set()
            if isinstance(e, DeviceMapFailed):  # its pipe to the server is broken for good
                self._shutdown(graceful=False)
            raise
        log.info("joined psserver %s:%d as %s (model %s, update %s, optimizer %s, --compute %s --step %s%s)",
                 config.server_host, config.server_port, self.name, self.spec.name, self.info["update"],
                 self.info["optimizer"]["name"], self.info["compute"], self.step_protocol,
                 f" on {self.device}" if self.info["compute"] == "trainer" else "")

    def _told(self, notices: list[str]) -> None:
        """What the server told along with a call (a step its guard dropped, an eviction: its
        reason is kept in :attr:`evicted`, for a run that ends before its next call fails)."""
        for notice in notices:
            log.warning("%s", notice)
            if notice.startswith(EVICTION_NOTICE):
                self.evicted = notice[len(EVICTION_NOTICE):]

    def call(self, op: str, *args):
        """``op`` of the server half of this session's step protocol (the trainer half's channel);
        what the server tells along (a step it dropped) is logged."""
        result, notices, self.progress = rpc.rpc_sync(rendezvous.SERVER_NAME, calls.call,
                                                      args=(self.name, op, args, self.report))
        self._told(notices)
        return result

    def call_async(self, op: str, *args):
        """``op`` without waiting (a gradient's part, sent while backward goes on): a future whose
        ``wait()`` gives its result or raises as :meth:`call` would."""
        def result(future):
            value, notices, self.progress = future.value()  # raises what the call raised
            self._told(notices)
            return value

        # With the report: a call that hands in counted steps (a DiLoCo fragment's sync) records them.
        return rpc.rpc_async(rendezvous.SERVER_NAME, calls.call, args=(self.name, op, args, self.report)).then(result)

    def call_each(self, op: str, args: list[tuple]) -> list:
        """``op`` on every server process at once, ``args[i]`` for server i; their results in
        order. When any failed (after all have answered), ``PartitionCallError`` naming it."""
        return self.call_each_async(op, args).wait()

    def call_each_async(self, op: str, args: list[tuple]) -> EachCall:
        """:meth:`call_each` without waiting (a streaming fragment's parts): its ``wait()``
        gives the results or raises as :meth:`call_each` would."""
        return EachCall(self, [rpc.rpc_async(name, calls.call, args=(self.name, op, a, self.report if i == 0 else None))
                               for i, (name, a) in enumerate(zip(self.servers, args, strict=True))])

    def _heartbeat(self) -> None:
        interval = float(self.info["heartbeat_interval"])
        while not self._stop.wait(interval):
            try:
                rpc.rpc_async(rendezvous.SERVER_NAME, calls.heartbeat, args=(self.name, self.report),
                              timeout=max(1.0, interval * 4))
            except RuntimeError:  # the training loop reports a lost server
                pass

    def host_trainers(self) -> int:
        """Live trainers on this host as the server knows them, this one included."""
        return int(rpc.rpc_sync(rendezvous.SERVER_NAME, calls.host_trainers, args=(self.name,),
                                timeout=min(self.config.rpc_timeout, PROBE_TIMEOUT_S)))

    def probe(self) -> str:
        """The server's state, asked as a heartbeat (``calls.NOT_A_MEMBER`` once this trainer
        was evicted); an RPC error when the server is gone."""
        return rpc.rpc_sync(rendezvous.SERVER_NAME, calls.heartbeat, args=(self.name, self.report),
                            timeout=min(self.config.rpc_timeout, PROBE_TIMEOUT_S))

    def leave(self) -> None:
        """Hand in what the protocol owes, leave the server and the RPC group (once)."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        try:
            self.protocol.flush()
            rpc.rpc_sync(rendezvous.SERVER_NAME, calls.leave, args=(self.name, self.report), timeout=10)
            self._shutdown(graceful=True)
        except Exception:  # noqa: BLE001 - server already gone: leave locally
            self._shutdown(graceful=False)
        rendezvous.forget_store(self.url)

    def abandon(self) -> None:
        """Drop a session whose server is gone (or evicted it), without talking to it."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._shutdown(graceful=False)
        rendezvous.forget_store(self.url)

    def _shutdown(self, graceful: bool) -> None:
        protocol = getattr(self, "protocol", None)
        if protocol is not None:
            protocol.close()
        self.info = {}
        if not torch_rpc.agent_is_set():
            return
        if graceful:
            done = threading.Event()

            def graceful_leave() -> None:
                try:
                    rpc.shutdown(graceful=True, timeout=10)
                except Exception:  # noqa: BLE001
                    log.debug("graceful RPC shutdown failed", exc_info=True)
                finally:
                    done.set()

            threading.Thread(target=graceful_leave, daemon=True).start()
            if done.wait(20):
                return
            log.warning("leaving the RPC group timed out; shutting down locally")
        try:
            rpc.shutdown(graceful=False)
        except Exception:  # noqa: BLE001
            log.debug("local RPC shutdown failed", exc_info=True)


DEFAULT_MODEL = "mnist_cnn"
"""A trainer's model when neither it nor its server names one."""


def choose_model(config: TrainerConfig, published: dict) -> ModelSpec:
    """The trainer's model: its ``--model``, else the one the server's operator pinned (``serve
    --model``) when it is a registered name (installed code this trainer's own host provides),
    else ``mnist_cnn``. Code named by reference (``MODULE:ATTR``) that this trainer did not name
    itself is never built, whoever named it: a model another trainer brought, one a checkpoint
    recorded, and the pinned one too, since what a trainer learns of the server's model comes
    from the store, and whoever may write the store (anyone reaching it without a join token,
    any holder of one) could name code there or stand in for the server. ``UsageError`` for
    those, and for a model a server without ``--model`` cannot hold."""
    brought = published.get("model") if not published.get("pinned") else None
    if config.model is not None:
        spec = get_model_spec(config.model, config.model_args)
    elif published.get("pinned") and published.get("model"):
        name = published["model"]
        if not isinstance(name, str):
            raise UsageError(f"the server pins model {printable(name)}, which is not a model name")
        if names_code(published):
            raise UsageError(f"the server runs model {printable(name)}, code named by reference: psserver never runs "
                             "code that a peer named; give this trainer its model yourself (--model MODULE:ATTR of "
                             "your own code, or ps.replica(model))")
        spec = get_model_spec(name, published.get("model_args"))
        check_fits(spec, published.get("embedding_dim"))
    elif published.get("fingerprint") is not None and (brought, published.get("model_args") or {}) != (DEFAULT_MODEL,
                                                                                                       {}):
        raise UsageError(brought_model_refusal(brought))
    else:
        spec = get_model_spec(DEFAULT_MODEL)
    if spec.sparse and not published.get("pinned"):
        raise UsageError(f"model {spec.name} keeps embedding tables on the servers, which a server started without "
                         f"--model cannot hold: start psserver serve with --model {spec.name}")
    return spec


def check_fits(spec: ModelSpec, embedding_dim: int | None) -> None:
    """``UsageError`` before building the server's model when twice its bytes (the replica and
    its gradients) exceed what this process may allocate: the arguments come from the store,
    which anyone reaching it without a join token can write, and a vocabulary of 10^8 would
    otherwise be built first (gigabytes) and refused after."""
    size = model_bytes(spec, embedding_dim)
    available = available_memory()
    if size is not None and 2 * size > available:
        raise UsageError(f"the server's model {spec.name} with {printable(spec.args)} is {size / 2**30:.1f} GiB: a "
                         f"replica and its gradients exceed the {available / 2**30:.1f} GiB this trainer may allocate")


def names_code(published: dict) -> bool:
    """Whether the server's model (as ``published``) is code named by reference (``MODULE:ATTR``)."""
    name = published.get("model")
    return isinstance(name, str) and is_reference(name)


def server_model_spec(published: dict) -> ModelSpec:
    """The spec of the server's model on a trainer that runs none (the name is only shown)."""
    def never_built(**_: object) -> torch.nn.Module:
        raise UsageError("this trainer runs no model: the server runs it")

    return ModelSpec(name=str(published.get("model")), build=never_built, input_shape=None, num_classes=None,
                     description="the server's model, which this trainer does not run")


def printable(value: object, limit: int = 80) -> str:
    """A name a peer sent, fit for one log or error line: quoted, control characters escaped, cut short."""
    text = repr(value) if isinstance(value, str) else repr(type(value).__name__)
    return text if len(text) <= limit else text[:limit - 4] + "...'"


def brought_model_refusal(reference: str | None) -> str:
    """Why a trainer without ``--model`` does not take the model another trainer brought."""
    return (f"the server holds a model another trainer brought ({printable(reference) if reference else 'unnamed'}); "
            "psserver never runs code that a peer named: give this trainer its model yourself (--model MODULE:ATTR "
            "of your own code, or ps.replica(model))")


def class_reference(cls: type) -> str:
    """``MODULE:QUALNAME`` of a model's class as a user can import it: a class of a script run
    with ``python -m pkg.train`` is ``pkg.train:Net``, not ``__main__:Net`` (one of a script run
    by its path stays ``__main__:...``: nothing imports it by a name)."""
    module = cls.__module__
    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None and spec.name and spec.name != "__main__":
            module = spec.name
    return f"{module}:{cls.__qualname__}"


def instance_spec(model: torch.nn.Module) -> ModelSpec:
    """The spec of a model the library was handed as an instance (``Connection.replica``): named
    by its class, its loss and metric the defaults of a user's model."""
    cls = type(model)
    return ModelSpec(name=class_reference(cls), build=lambda: model, input_shape=None,
                     num_classes=None, description=f"the {cls.__qualname__} instance this trainer brought")


def trainer_device(name: str) -> torch.device:
    """The device of ``--device``, made current for CUDA (``UsageError`` when this host does not have it)."""
    dev = resolve_device(name, "--device")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def join_failure(e: BaseException, where: str) -> Exception:
    """What a failed join call means: the server's refusal (a remote exception: ``UsageError``),
    or no answer at all (the server went away mid-join: ``JoinLost``, which ``--reconnect`` waits out)."""
    if re.search(r"On WorkerInfo", str(e)):
        return UsageError(f"server refused the join: {remote_message(e)}")
    return JoinLost(f"the join call to {where} failed: {remote_message(e)}")


def remote_message(e: BaseException) -> str:
    """The useful line of an RPC error: the remote exception's message, not its traceback.

    Remote exceptions arrive as ``On WorkerInfo(...):\nValueError('...')\nTraceback ...``.
    """
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if lines and re.match(r"^(\w+: )?On WorkerInfo", lines[0]) and len(lines) >= 2:
        m = re.match(r"^\w+\((['\"])(.*)\1\)$", lines[1])
        return m.group(2) if m else lines[1]
    return lines[0] if lines else type(e).__name__


