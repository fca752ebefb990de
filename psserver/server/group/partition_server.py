"""``psserver serve --server-rank i`` for i > 0: one partition of the parameters, behind RPC.

It holds the pieces of the model's parameters its rank gets in the partition plan
(``psserver.common.partition``) and applies the shared optimizer to them, as the step engine
does for a whole model. Trainers call it directly, with the same RPC functions and step
protocol as server 0 (``--step pushpull``), in parallel with their calls to the others.
Everything else is server 0's (``psserver.server.group.server_group``): admission, membership (a
trainer is a member here once server 0 says it joined), the control plane, the checkpoint
schedule (this server writes its partition when server 0 asks and loads the one it names).

It watches server 0 too: when server 0 stops answering, this server stops (exit 3), as a
trainer without ``--reconnect`` does; restarted, it registers again and loads what server 0
says.

With ``--state-dir`` its state lives in memory (``psserver.server.state.memory``): a process
of it that dies leaves its parameters, rows and optimizer state there, and the one restarted in
its place tells server 0 which global step it found. Server 0 lets it continue from there, and
the others keep theirs, when it is the same server 0 that had this server's state from the start
and updates are not synchronous (``ServerGroup.register``); otherwise what it found goes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc

from psserver.common import calls, rendezvous, torch_rpc
from psserver.common.devices import resolve_devices
from psserver.common.messages import JoinRequest, ServerHello
from psserver.config import OptimizerConfig, ServerConfig
from psserver.errors import ServerLost, UsageError
from psserver.exporters import start_server_process_exporter
from psserver.models.layout import ModelLayout
from psserver.server.checkpoints.checkpointing import CheckpointPolicy
from psserver.server.endpoint import Endpoint
from psserver.server.engine.engine import StepEngine
from psserver.server.engine.shard import warm_optimizers
from psserver.server.engine.sync_updates import FollowerSyncUpdater
from psserver.server.group import peers
from psserver.server.membership import Member
from psserver.server.state.memory import MemoryState
from psserver.server.steps import HALVES
from psserver.telemetry import TrainerStatus
from psserver.utils.cpp_log import quiet_cpp_warnings
from psserver.utils.memory import configure_host_allocator, freeze_long_lived

log = logging.getLogger(__name__)

PART_WAIT_MAX_S = 30.0
"""The longest a part of a version waits for its step."""

WATCH_S = 1.0
MISSED_TO_LOSE = 3
"""Unanswered pings of server 0 in a row after which this server gives up on it."""
STOP_WAIT_S = 120.0
"""After SIGTERM while server 0 stops too: how long to wait for it to finish its final checkpoint."""


class Roster:
    """The trainers server 0 admitted, as the endpoint's membership (``seen``, ``is_member``):
    joins and leaves come from server 0, so this server evicts no one itself."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.members: dict[str, Member] = {}

    def add(self, request: JoinRequest, protocol: str) -> None:
        now = time.time()
        with self.lock:
            self.members[request.name] = Member(TrainerStatus(request.rank, request.name, request.host, now, now,
                                                              step=protocol), -1, protocol)

    def remove(self, name: str) -> Member | None:
        with self.lock:
            return self.members.pop(name, None)

    def seen(self, name: str) -> Member:
        with self.lock:
            return self.members[name]

    def is_member(self, name: str) -> bool:
        with self.lock:
            return name in self.members

    def evict(self, name: str, reason: str) -> None:
        """Server 0's guard decides evictions (every server's guard sees the same norm)."""
        log.debug("not evicting %s here (%s): server 0 decides", name, reason)

    def mean_loss(self) -> float | None:
        return None


class PartitionServer:
    """One partition server; ``peer_ops`` are what server 0 calls."""

    peer_ops = ("trainer_joined", "trainer_gone", "status", "save", "load", "shutdown", "sync_round", "adopt",
                "part_at")

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine = StepEngine(config, resolve_devices(config.devices))
        self.policy = CheckpointPolicy(config, self.engine)
        self.memory = MemoryState(config.memory_state, config.server_rank) if config.memory_state.enabled else None
        try:
            if self.memory is not None:
                self.memory.prepare()
            self.policy.restore()  # checks the directory; loads nothing until server 0 says what
        except BaseException:
            self.engine.close()
            raise
        self.halves = {name: half(self.engine) for name, half in HALVES.items()}
        self.endpoint = Endpoint(config, self.engine, self.halves, after_call=lambda: None)
        self.roster = Roster()
        self._shutdown = threading.Event()
        self._reason = ""
        self.exit_code = 0
        self._serving = False  # start() completed: a stop after it may release the state in memory
        log.info("server %d of %d: %d of the %s's parameters on %s", config.server_rank, config.num_servers,
                 self.engine.num_params, config.model, self.engine.devices[0])

    # ---- start, serve, stop ---------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        host, port = cfg.coordinator_address
        where = f"{host}:{port}"
        torch_rpc.check_version()
        torch_rpc.restrict_unpickler()
        quiet_cpp_warnings()  # TensorPipe's WARNING for every peer that leaves
        token = rendezvous.join_token(cfg)
        store, url = rendezvous.connect_store(host, port, 60.0, cfg.rpc_timeout, token, until_serving=False)
        rpc_id, _ = rendezvous.request_admission(store, cfg.server_rank, where, server=True)
        rendezvous.set_transport_interface(cfg.host, local=True)
        peers.install(self)
        calls.install(self.endpoint)
        try:
            rpc.init_rpc(rendezvous.server_name(cfg.server_rank), rank=rpc_id, world_size=None,
                         rpc_backend_options=rendezvous.backend_options(url, cfg.rpc_timeout, cfg.rpc_threads))
        except RuntimeError as e:
            raise ServerLost(f"cannot join the RPC group of server 0 at {where}: {str(e).splitlines()[0]}") from None
        found = self.memory.load() if self.memory is not None else None
        hello = ServerHello(cfg.server_rank, cfg.num_servers, cfg.model, cfg.seed, socket.gethostname(), os.getpid(),
                            self.engine.num_params, self.policy.directory is not None,
                            dataclasses.asdict(cfg.lr_schedule),
                            None if found is None else int(found[0]["global_step"]))
        reply = rpc.rpc_sync(rendezvous.SERVER_NAME, peers.server_call, args=("register", (hello,)))
        if "error" in reply:
            self._leave_group()
            raise UsageError(reply["error"])
        if reply["optimizer"] is not None:
            self.engine.agree_optimizer(OptimizerConfig(**reply["optimizer"]), "server 0")
        else:  # the first trainer's join waits for this process's first optimizer too
            warm_optimizers()
        if found is not None and reply.get("memory"):
            self.policy.restore_memory(found)
        else:
            if found is not None:
                assert self.memory is not None
                self.memory.forget_found()
                log.warning("server 0 did not continue from the state in memory (global step %s): %s",
                            found[0]["global_step"], reply.get("memory_why") or "it starts this server afresh")
            if reply["resume"] is not None:
                self.policy.load_partition(int(reply["resume"]["step"]), str(reply["resume"]["run"]))
        if self.memory is not None:
            self.memory.attach(self.engine, self.policy.live_snapshot, self.policy.run_id)
        self._follow_rounds(int(reply["rounds"]))
        self.endpoint.open(self.roster)  # type: ignore[arg-type]
        self._serving = True
        log.info("server %d serving its partition on %s (server 0 at %s)", cfg.server_rank, cfg.host, where)

    def serve_forever(self) -> None:
        missed = 0
        while not self._shutdown.wait(WATCH_S):
            try:
                rpc.rpc_sync(rendezvous.SERVER_NAME, rendezvous.ping, timeout=2.0)
                missed = 0
            except RuntimeError as e:
                missed += 1
                if missed >= MISSED_TO_LOSE:
                    log.error("lost server 0 (%s): stopping (restart this server once server 0 is back)",
                              str(e).splitlines()[0] if str(e) else type(e).__name__)
                    self.exit_code = 3
                    self.request_shutdown("lost server 0")

    def request_shutdown(self, reason: str) -> None:
        if not self._shutdown.is_set():
            self._reason = reason
            self._shutdown.set()

    def on_signal(self, signum: int) -> None:
        """SIGTERM, SIGINT: when server 0 stops too it has this server wait for its final
        checkpoint, then stop; otherwise this server leaves now (server 0 waits for it)."""
        name = signal.Signals(signum).name

        def ask() -> None:
            try:
                answer = rpc.rpc_sync(rendezvous.SERVER_NAME, peers.server_call,
                                      args=("stopping", (self.config.server_rank,)), timeout=5.0)
            except RuntimeError:
                answer = "go"
            if answer == "wait":
                log.info("received %s while server 0 stops: waiting for its final checkpoint", name)
                threading.Timer(STOP_WAIT_S, self.request_shutdown, args=(f"received {name}",)).start()
            else:
                self.request_shutdown(f"received {name}")

        threading.Thread(target=ask, name="psserver-stopping", daemon=True).start()

    def stop(self) -> None:
        log.info("stopping: %s", self._reason or "shutdown")
        self.endpoint.drain()
        self.engine.drain()
        self.engine.wait_idle(5.0)
        if self.policy.checkpointer is not None:
            self.policy.checkpointer.wait()
        for half in self.halves.values():
            half.close()
        self._leave_group()
        self.engine.close()
        if self.memory is not None and self._serving and not self.exit_code:
            self.memory.release()  # a clean stop (after lost server 0, a restart may continue from it)
        log.info("server %d stopped", self.config.server_rank)

    def _leave_group(self) -> None:
        peers.install(None)
        if torch_rpc.agent_is_set():
            with contextlib.suppress(RuntimeError):
                rpc.shutdown(graceful=False)
        calls.install(None)

    # ---- what server 0 calls ----------------------------------------------------------------

    def trainer_joined(self, request: JoinRequest, protocol: str, optimizer: dict | None) -> None:
        if optimizer is not None:
            self.engine.agree_optimizer(OptimizerConfig(**optimizer), "server 0")
        self.halves[protocol].join_info(request.name, request)
        self.roster.add(request, protocol)
        self.engine.trainer_joined(request.name)

    def adopt(self, layout: dict, reference: str | None, args: dict, pieces: torch.Tensor) -> None:
        """Server 0 took the model from the first trainer: this server's pieces of it."""
        self.engine.adopt_partition(ModelLayout.from_dict(layout), pieces, reference, args or {})

    def trainer_gone(self, name: str, rounds_closed: int | None = None, in_open_round: bool = False) -> None:
        """``name`` left; server 0 says (sync) how many rounds it had closed then, and whether the
        trainer's last gradient is in the round still open."""
        if rounds_closed is not None and (isinstance(rounds_closed, bool) or not isinstance(rounds_closed, int)
                                          or not isinstance(in_open_round, bool)):
            raise ValueError("trainer_gone(name: str, rounds_closed: int, in_open_round: bool)")
        member = self.roster.remove(name)
        if member is not None:
            updater = self.engine.updater
            if rounds_closed is not None and isinstance(updater, FollowerSyncUpdater):
                self.engine.compute.run(updater.leaving, name, rounds_closed, in_open_round)
            self.halves[member.protocol].trainer_gone(name, True)
            self.engine.trainer_gone(name)

    def status(self) -> dict[str, Any]:
        """Server 0's watch: progress, bytes and the embedding tables, as plain types (server 0's
        RPC unpickler takes nothing else)."""
        tables = self.engine.tables
        return {"updates": self.engine.global_step, "bytes": sum(s.num_bytes for s in self.engine.shards),
                "tables": [dataclasses.asdict(t) for t in tables.status()] if tables is not None else []}

    def part_at(self, step: int, timeout: float) -> tuple[torch.Tensor, None] | None:
        """This partition's pieces as one flat buffer at global step ``step``, for a reader's
        version (``psserver.server.engine.step_copies``); None when past it or not reached in time."""
        if isinstance(step, bool) or not isinstance(step, int) or not isinstance(timeout, int | float):
            raise ValueError("part_at(step: int, timeout: float)")
        part = self.engine.step_copies.at(step, min(float(timeout), PART_WAIT_MAX_S))
        return None if part is None else (part[0], None)

    def save(self, step: int, run: str) -> str:
        return self.policy.save_partition(step, run)

    def load(self, step: int, run: str, rounds: int) -> None:
        for name in list(self.roster.members):
            self.trainer_gone(name)
        self.policy.load_partition(step, run)
        self._follow_rounds(rounds)

    def sync_round(self, round_no: int, contributors: list[str]) -> None:
        updater = self.engine.updater
        if isinstance(updater, FollowerSyncUpdater):
            self.engine.compute.run(updater.decide, round_no, contributors)

    def _follow_rounds(self, rounds: int) -> None:
        if isinstance(self.engine.updater, FollowerSyncUpdater):
            self.engine.updater.start_at(rounds)

    def shutdown(self, reason: str) -> None:
        self.request_shutdown(reason)


def run_partition_server(config: ServerConfig) -> int:
    """``psserver serve --server-rank i`` (i > 0): 0 after a stop, 3 when server 0 was lost."""
    torch.set_num_threads(config.compute_threads or os.cpu_count() or 1)
    configure_host_allocator(config.allocator)
    metrics = start_server_process_exporter(config.observability, config.server_rank)  # a taken port fails first
    try:
        server = PartitionServer(config)
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise
    previous = {}

    def on_signal(signum, frame):  # noqa: ARG001
        server.on_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        try:
            server.start()
        except BaseException:
            server.stop()
            raise
        freeze_long_lived()
        server.serve_forever()
        server.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if metrics is not None:
            metrics.close()
    if server.exit_code:
        raise ServerLost(f"server {config.server_rank} lost server 0 at {config.coordinator}")
    return 0
