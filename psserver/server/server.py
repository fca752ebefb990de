"""``psserver serve``: builds the parameter server from its parts, serves, drains, stops.

The parts: the engine (the model's stages and the shared optimizer, ``engine``), the server
halves of the step protocols (``protocols``), the RPC endpoint (``endpoint``), membership
(``membership``), the checkpoint policy (``checkpointing``) and the control plane's view
(``status``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading

import torch
import torch.distributed.rpc as rpc

from psserver import __version__
from psserver.common import calls, rendezvous, torch_rpc, transport
from psserver.common.devices import resolve_devices
from psserver.config import ServerConfig
from psserver.control.server import ControlServer
from psserver.exporters import start_exporters
from psserver.server.admission import AdmissionDesk, PublishedKeys
from psserver.server.checkpoints.checkpointing import CheckpointPolicy
from psserver.server.endpoint import Endpoint
from psserver.server.engine.engine import StepEngine
from psserver.server.engine.shard import warm_optimizers
from psserver.server.engine.sync_updates import SyncUpdater
from psserver.server.group.server_group import ServerGroup
from psserver.server.membership import Membership
from psserver.server.state.memory import MemoryState
from psserver.server.status import ServerView
from psserver.server.steps import HALVES
from psserver.server.versions import Versions
from psserver.utils.cpp_log import quiet_cpp_warnings
from psserver.utils.memory import configure_host_allocator, freeze_long_lived

log = logging.getLogger(__name__)


class ParameterServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine = StepEngine(config, resolve_devices(config.devices))
        self.policy = CheckpointPolicy(config, self.engine)
        self.memory = MemoryState(config.memory_state, config.server_rank) if config.memory_state.enabled else None
        try:
            found = None
            if self.memory is not None:
                self.memory.prepare()
                found = self.memory.load()
            resumed = self.policy.restore(found)
            if self.memory is not None:
                self.memory.attach(self.engine, self.policy.live_snapshot, self.policy.run_id)
        except BaseException:
            self.engine.close()
            raise
        self.halves = {name: half(self.engine) for name, half in HALVES.items()}
        self.endpoint = Endpoint(config, self.engine, self.halves, after_call=self.policy.maybe_save)
        self.view = ServerView(config, self.engine, self.endpoint, self.policy, self.request_shutdown)
        self.view.memory = self.memory
        # (several processes: server 0's group puts each version together from every process's part)
        self.versions = Versions(lambda: self.group.model_version() if self.group is not None
                                 else self.engine.model_version(), lambda: self.engine.global_step,
                                 config.control.publish_interval, lambda: self.engine.model_ref or "",
                                 self.engine.table_rows, self.engine.table_changes)
        """Versions of the model for readers of the weights (the control plane's ``WeightsService``)."""
        self.view.versions = self.versions
        self.engine.listeners += [self.policy.note_step, self.view.on_step, self.versions.on_step]
        self.membership: Membership | None = None
        self.desk: AdmissionDesk | None = None
        self.published = PublishedKeys()
        self.store = None
        self.group: ServerGroup | None = None
        if config.num_servers > 1:
            self.group = ServerGroup(config, self.engine, self.policy, self._set_state)
            self.group.resume_step = resumed if found is None else None
            self.group.from_memory = found is not None
            self.group.on_rollback = self.versions.new_history
            self.policy.before_write = self.group.save_partitions
            self.endpoint.group = self.group
            self.view.group = self.group
            if isinstance(self.engine.updater, SyncUpdater):
                self.engine.updater.round_listeners.append(self.group.round_closed)
        self._shutdown = threading.Event()
        self._shutdown_reason = ""
        self._open = False  # start() completed and stop() not begun: health may say SERVING
        self._state_lock = threading.Lock()
        if not self.engine.has_model:
            log.info("no --model: the first trainer that joins brings the model (its layout and initial values)")
        else:
            log.info("model %s (%d parameters%s) in %d stage(s) on %s%s", self.engine.model_ref,
                     self.engine.model_params,
                     f", {self.engine.num_params} in this server's partition" if self.engine.plan is not None else "",
                     len(self.engine.shards), ", ".join(str(d) for d in self.engine.devices),
                     f", resumed at step {resumed}" if resumed is not None else "")

    def start(self) -> None:
        """Open the RPC endpoint; trainers can join once this returns."""
        cfg = self.config
        torch_rpc.check_version()
        torch_rpc.restrict_unpickler()
        quiet_cpp_warnings()  # TensorPipe's WARNING for every peer that leaves
        token = rendezvous.join_token(cfg)
        raw_store, self.store, url = rendezvous.create_server_store(cfg.host, cfg.port, cfg.rpc_timeout, token)
        self.published.set(self.store, rendezvous.KEY_SERVER_STATE, rendezvous.STARTING)
        self.publish_model()
        self.endpoint.on_model = self.publish_model
        rendezvous.set_transport_interface(cfg.host, local=True)
        calls.install(self.endpoint)
        rpc.init_rpc(rendezvous.SERVER_NAME, rank=0, world_size=None,
                     rpc_backend_options=rendezvous.backend_options(
                         url, cfg.rpc_timeout, cfg.rpc_threads,
                         # the CUDA devices trainers' device maps may point at (psserver.common.transport)
                         devices=[d for d in self.engine.devices if d.type == "cuda"] or None))
        self.membership = Membership(self.store, cfg.trainer_timeout, self.endpoint.trainer_gone)
        self.membership.start()
        group = self.group
        if group is not None:
            group.membership, group.evict_worker = self.membership, self.membership.evict_worker
            group.start()
        self.desk = AdmissionDesk(self.store, self.membership.admit, self.published,
                                  group.admit_server if group is not None else None)
        self.desk.start()
        # Before the endpoint opens: the first join must find the rounds waiting.
        memory, updater = self.memory, self.engine.updater
        if memory is not None and memory.disabled is None and memory.ranks and isinstance(updater, SyncUpdater):
            # Continued from memory: the trainers of before come back; rounds wait for them.
            updater.await_rejoins(len(memory.ranks), self.drain_timeout())
        elif isinstance(updater, SyncUpdater):
            # A fresh start: the first rounds are of K trainers, as asked, unless the others are
            # later than a lost trainer would be.
            updater.await_first_trainers(cfg.trainer_timeout)
        self.endpoint.open(self.membership)
        if self.engine.optimizer_config is None:
            warm_optimizers()
        if group is None:
            self._set_state(rendezvous.SERVING)
        else:
            with group.lock:
                missing = group.missing()
                self._set_state(rendezvous.STARTING if missing else rendezvous.SERVING)
            if missing:
                log.info("waiting for server process(es) %s of %d to register", ", ".join(map(str, missing)),
                         cfg.num_servers)
        self.published.set(raw_store, rendezvous.KEY_HELLO, rendezvous.HELLO_TOKEN if token else rendezvous.HELLO_OPEN)
        if token is None:
            log.warning("no join token: any peer that reaches %s:%d can join this server and read or write its "
                        "store (--join-token-file or PSSERVER_JOIN_TOKEN)", cfg.host, cfg.port)
        with self._state_lock:  # health SERVING now, unless a server process is missing
            self._open = True
            if self.endpoint.state == rendezvous.SERVING:
                self.view.ready.set()
        log.info("psserver %s serving %s on %s:%d (update=%s%s)", __version__,
                 self.engine.model_ref or "<the-first-trainer's-model>", cfg.host, cfg.port,
                 cfg.update, (f", outer {cfg.outer}" if cfg.update == "diloco" else "")
                 + (f", K={cfg.sync_trainers}" if cfg.rounds else ""))

    def publish_model(self) -> None:
        """The model as joining trainers need it before they join (``rendezvous.KEY_MODEL``)."""
        engine = self.engine
        # "pinned": the operator's --model, which trainers without one build. A model a trainer
        # (or a checkpoint) brought is only named: no trainer runs code another one named.
        info = {"model": engine.model_ref, "model_args": engine.model_args, "pinned": self.config.model is not None,
                "seed": self.config.seed,
                "embedding_dim": self.config.embedding.dim,
                "fingerprint": engine.layout.fingerprint() if engine.layout is not None else None,
                # Where the model lives, for each trainer's choice of path (psserver.common.transport).
                "devices": [str(d) for d in engine.devices], "num_servers": self.config.num_servers,
                "host_id": transport.host_id()}
        self.published.set(self.store, rendezvous.KEY_MODEL, json.dumps(info))

    def _set_state(self, state: str) -> None:
        """``SERVING``; with several server processes also ``STARTING`` or ``WAITING`` while one
        is missing (no joins, no steps). Health (``view.ready``) is SERVING only in ``SERVING``
        once the endpoint is open: a readiness probe admits trainers only when they can train."""
        with self._state_lock:
            self.endpoint.state = state
            if self.store is not None:
                self.published.set(self.store, rendezvous.KEY_SERVER_STATE, state)
            if self._open and state == rendezvous.SERVING:
                self.view.ready.set()
            else:
                self.view.ready.clear()

    def request_shutdown(self, reason: str = "shutdown requested") -> None:
        if self.group is not None:
            self.group.stop_requested.set()
        if not self._shutdown.is_set():
            self._shutdown_reason = reason
            self._shutdown.set()

    def serve_forever(self) -> None:
        self.policy.start()
        # Woken every second: a SIGTERM the kernel hands to another thread (one of torch's) only
        # sets a flag, and its handler runs once this thread runs Python again.
        while not self._shutdown.wait(1.0):
            pass

    def drain_timeout(self) -> float:
        """How long ``stop`` waits for steps in flight: a dead trainer's open step goes when it
        is evicted, after ``--trainer-timeout``."""
        return max(10.0, 2 * self.config.trainer_timeout)

    def stop(self) -> None:
        """Drain: refuse joins and new steps, let those in flight finish, checkpoint, leave."""
        log.info("stopping: %s", self._shutdown_reason or "shutdown")
        if self.group is not None:
            self.group.stop_requested.set()
        self.endpoint.drain()
        with self._state_lock:
            self._open = False
            self.view.ready.clear()
        if self.store is not None:
            with contextlib.suppress(RuntimeError):  # a store that is gone already
                self.published.set(self.store, rendezvous.KEY_SERVER_STATE, rendezvous.DRAINING)
        self.engine.drain()
        timeout = self.drain_timeout()
        open_steps = self.engine.wait_idle(timeout)
        in_flight = self.endpoint.wait_idle(1.0)  # a call that closed the last step is returning
        if open_steps or in_flight:
            log.warning("stopping with %d step(s) still open (%s) and %d call(s) in flight after %.0fs",
                        len(open_steps), ", ".join(open_steps), in_flight, timeout)
        self.policy.stop()
        if self.group is not None:
            self.group.stop()  # after the final checkpoint, which needs every partition
        if self.desk is not None:
            self.desk.stop()
        if self.membership is not None:
            self.membership.stop()
            self.membership.remove_all()
        for half in self.halves.values():
            half.close()
        if torch_rpc.agent_is_set():
            rpc.shutdown(graceful=False)
        calls.install(None)
        self.engine.close()
        self.endpoint.state = "STOPPED"
        log.info("psserver stopped at global step %d", self.engine.global_step)


def run_server(config: ServerConfig) -> int:
    """``psserver serve``: returns the exit code (1 when the final checkpoint failed)."""
    if config.server_rank > 0:
        from psserver.server.group.partition_server import run_partition_server

        return run_partition_server(config)
    torch.set_num_threads(config.compute_threads or os.cpu_count() or 1)
    configure_host_allocator(config.allocator)  # before the RPC agent's threads exist
    server = ParameterServer(config)
    control = ControlServer(server.view, config.control, weights=server.versions) if config.control.enabled \
        else contextlib.nullcontext()
    obs = config.observability
    metrics = start_exporters(server.view, obs) if obs.metrics_port is not None or obs.tensorboard_dir else None
    previous = {}

    def on_signal(signum, frame):  # noqa: ARG001
        server.request_shutdown(f"received {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        with control:
            server.start()
            freeze_long_lived()  # torch, the model, the RPC layer: out of every later full collection
            server.serve_forever()
            server.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if metrics is not None:
            metrics.close()
    if not server.policy.final_ok:
        return 1  # a failed final checkpoint: logged as it happened (the state in memory stays)
    if server.memory is not None:
        server.memory.release()
    return 0
