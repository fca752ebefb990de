"""Server 0's side of a parameter server spread over several processes (``--num-servers``).

Server 0 coordinates; the others (``psserver.server.group.partition_server``) each hold a partition of
the parameters with its optimizer state. Server 0 admits them (the admission desk hands them
RPC ids as it does trainers), answers their registration with what they must load, tells them
which trainers joined and left (a partition server keeps no membership of its own), watches
them, and has each write its partition before its own file completes a checkpoint.

A server that stops answering is *lost*: server 0 says so, evicts it from the RPC group and
waits (state ``WAITING``: no joins, no steps; trainers exit 3 or, with ``--reconnect``, wait).
When it registers again, every server goes back to the newest complete checkpoint (server 0's
file exists only for those) and training continues: the steps applied on some partitions and
not on others since then are undone together. Unless it comes back with its state in memory
(``--state-dir``) and updates are not synchronous: then it continues from there and no server
goes back. Each trainer numbers its gradients and every server keeps the last number it applied
per rank, so the trainers (evicted, they rejoin) hand in again the step that failed on the dead
server, and each server applies it once: the one that had, not again.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.rpc as rpc

from psserver.common import rendezvous
from psserver.common.messages import JoinRequest, ServerHello
from psserver.common.partition import make_plan
from psserver.common.tensors import unflatten_into
from psserver.config import ServerConfig
from psserver.errors import NoVersion
from psserver.models.layout import PARAMETER, ModelLayout
from psserver.server.group import peers
from psserver.telemetry import ServerProcessStatus, TableStatus

if TYPE_CHECKING:
    from psserver.server.checkpoints.checkpointing import CheckpointPolicy
    from psserver.server.engine.engine import StepEngine
    from psserver.server.membership import Membership

log = logging.getLogger(__name__)

WATCH_S = 1.0
"""How often server 0 asks every other server process how it is."""
MISSED_TO_LOSE = 2
"""Unanswered watches in a row after which a server process is lost."""
PING_TIMEOUT_S = 2.0
SAVE_TIMEOUT_S = 300.0
STOPPING_GRACE_S = 2.0
"""How long server 0 waits for its own stop before telling a server that received SIGTERM to
go: a job-wide SIGTERM (``scancel``, a deleted pod set) reaches every process at about the same
moment, and which of them asks first is chance."""
"""How long server 0 waits for a partition of a checkpoint to be written."""
VERSION_TRIES = 6
"""Steps tried for a reader's version before it is refused (a process past the step asked)."""
PART_WAIT_S = 10.0
"""How long each process waits for the step of a version's part."""


@dataclass
class Peer:
    rank: int
    name: str
    state: str = "MISSING"
    host: str = ""
    pid: int = 0
    rpc_id: int = -1
    parameters: int = 0
    parameter_bytes: int = 0
    updates: int = 0
    last_seen: float | None = None
    missed: int = 0
    tables: list[TableStatus] = field(default_factory=list)
    """Its embedding tables as it last reported them (kept while it is lost)."""


class ServerGroup:
    """The other server processes, as server 0 knows them; ``peer_ops`` are what they call."""

    peer_ops = ("register", "stopping")

    def __init__(self, config: ServerConfig, engine: StepEngine, policy: CheckpointPolicy,
                 set_state: Callable[[str], None]) -> None:
        self.config = config
        self.engine = engine
        self.policy = policy
        self.set_state = set_state
        """Publishes server 0's state (``SERVING`` once all are there, ``WAITING`` when one is missing)."""
        self.peers = {i: Peer(i, rendezvous.server_name(i)) for i in range(1, config.num_servers)}
        self.membership: Membership | None = None
        self.evict_worker: Callable[[str, int], None] | None = None
        """Removes a dead process from the RPC group (``Membership.evict_worker``)."""
        self.resume_step: int | None = None
        """The checkpoint server 0 started from: every server loads its partition of it."""
        self.on_rollback: Callable[[], None] | None = None
        """Called once every server went back to a checkpoint (readers' versions start a new history)."""
        self.from_memory = False
        """Server 0 continues from its state in memory: the others continue from theirs, or all go
        back to a checkpoint when one has none."""
        self.stop_requested = threading.Event()
        """Server 0 was asked to stop (a signal, ``psserver stop``): a server process that
        received SIGTERM too waits for the final checkpoint instead of leaving."""
        self._complete_once = False  # all servers were there at least once (training may have begun)
        self._serving: tuple[Peer, ...] = ()  # read without the lock (round_closed runs under the updater's)
        self.lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="psserver-servers", daemon=True)

    # ---- what trainers and status see -----------------------------------------------------

    def names(self) -> list[str]:
        return [rendezvous.SERVER_NAME] + [self.peers[i].name for i in sorted(self.peers)]

    def join_info(self) -> dict[str, Any]:
        assert self.engine.plan is not None
        return {"servers": self.names(), "plan": self.engine.plan.to_dict()}

    def missing(self) -> list[int]:
        with self.lock:
            return [p.rank for p in self.peers.values() if p.state != "SERVING"]

    def statuses(self) -> list[ServerProcessStatus]:
        now = time.monotonic()
        engine = self.engine
        own = ServerProcessStatus(0, rendezvous.SERVER_NAME, self.config.host, "SERVING", engine.num_params,
                                  sum(s.num_bytes for s in engine.shards), engine.global_step, 0.0)
        with self.lock:
            others = [ServerProcessStatus(p.rank, p.name, p.host, p.state, p.parameters, p.parameter_bytes, p.updates,
                                          float("nan") if p.last_seen is None else now - p.last_seen)
                      for p in sorted(self.peers.values(), key=lambda p: p.rank)]
        return [own, *others]

    def table_statuses(self) -> list[TableStatus]:
        """The embedding tables of the other server processes, by rank (their counters as of the
        last watch; server 0's view adds the rates). Without the lock, as a step's listener reads
        them: the peers are fixed and the watch replaces each one's list whole."""
        return [t for p in sorted(self.peers.values(), key=lambda p: p.rank) for t in p.tables]

    # ---- admission and registration -------------------------------------------------------

    def admit_server(self, rank: int) -> str:
        """The admission desk's question for a server process: ``ADMITTED`` or why not."""
        if rank not in self.peers:
            return f"server rank {rank} is not part of this job (--num-servers {self.config.num_servers})"
        peer = self.peers[rank]
        if peer.state == "SERVING":
            if self._ping(peer):
                return f"server {rank} is already running ({peer.name} on {peer.host}, pid {peer.pid})"
            self._lose(peer, "it did not answer when a new server process asked for its rank")
        if self.membership is not None:  # its init_rpc calls every member: none may be dead
            self.membership.make_room(None, f"server process {rank} asked to join")
        return rendezvous.ADMITTED

    def register(self, hello: ServerHello) -> dict[str, Any]:
        """A server process joined the RPC group: check it, then tell it what to load."""
        cfg = self.config
        problems = []
        if hello.num_servers != cfg.num_servers:
            problems.append(f"--num-servers {hello.num_servers}, server 0 has {cfg.num_servers}")
        if hello.model != cfg.model or hello.seed != cfg.seed:
            problems.append(f"model {hello.model} (seed {hello.seed}), server 0 serves {cfg.model} (seed {cfg.seed})")
        plan = self.engine.plan
        # A server without --model holds nothing until server 0 gives it its pieces, or it
        # loads them from its partition of the checkpoint server 0 resumes from.
        if plan is not None and 0 < hello.rank < cfg.num_servers and hello.model is not None and \
                hello.parameters != plan.elements_per_server()[hello.rank]:
            problems.append(f"a partition of {hello.parameters} parameters, the plan gives it "
                            f"{plan.elements_per_server()[hello.rank]}")
        ours = asdict(cfg.lr_schedule)
        if hello.lr_schedule is not None and hello.lr_schedule != ours:
            problems.append(f"learning-rate schedule {_schedule_flags(hello.lr_schedule)}, server 0 steps "
                            f"{_schedule_flags(ours)} (give every server the same flags)")
        if cfg.checkpoint.directory is not None and not hello.checkpoints:
            problems.append("no --checkpoint-dir, but server 0 writes checkpoints: every server writes its partition")
        if hello.rank not in self.peers:
            problems.append(f"server rank {hello.rank} is not part of this job")
        if problems:
            why = "; ".join(problems)
            log.warning("refused server %d from %s: %s", hello.rank, hello.host, why)
            return {"error": f"server 0 refused this server: {why}"}
        with self.lock:
            peer = self.peers[hello.rank]
            info = rpc.get_worker_info(peer.name)
            resume: dict | None = None
            memory, why = self._continues_from_memory(hello)
            if memory:
                self._evict_trainers(f"server {peer.rank} was lost and comes back with its state in memory")
                log.warning("server %d comes back with its state in memory (its global step %d): no server goes back",
                            peer.rank, hello.memory_step)
            elif self._complete_once or self.from_memory:
                # Server 0 or the others hold steps this server's state does not: all go back.
                resume = self._roll_back(peer)
            elif self.resume_step is not None:
                resume = {"step": self.resume_step, "run": self.policy.run_id}
            peer.host, peer.pid, peer.rpc_id = hello.host, hello.pid, info.id
            peer.parameters, peer.missed, peer.last_seen = hello.parameters, 0, time.monotonic()
            peer.state = "SERVING"
            self._serving = tuple(p for p in self.peers.values() if p.state == "SERVING")
            if self.membership is not None:
                self.membership.peers.add(peer.name)
            log.info("server %d (%s) registered from %s, pid %d%s", peer.rank, peer.name, hello.host, hello.pid,
                     f"; it loads checkpoint step {resume['step']}" if resume else "")
            ready = not self.missing()
            if ready:
                self._complete_once = True
        if ready:
            self.set_state(rendezvous.SERVING)
            log.info("all %d server processes are serving", cfg.num_servers)
        optimizer = self.engine.optimizer_config
        return {"resume": resume, "optimizer": asdict(optimizer) if optimizer else None, "rounds": self._rounds(),
                "memory": memory, "memory_why": why}

    def _continues_from_memory(self, hello: ServerHello) -> tuple[bool, str]:
        """Whether a registering server continues from the state it found in memory (and why not)."""
        if hello.memory_step is None:
            return False, ""
        if not self._complete_once and not self.from_memory:
            return False, "server 0 started afresh or from a checkpoint since that state was written: every server " \
                          "starts from what it says"
        if self.config.rounds:
            return False, "a sync round in flight cannot be rebuilt: every server goes back to a checkpoint"
        return True, ""

    def _evict_trainers(self, why: str) -> None:
        """(lock held) The trainers still members: evicted (with ``--reconnect`` they rejoin)."""
        if self.membership is None:
            return
        with self.membership.lock:
            names = list(self.membership.members)
        for name in names:
            self.membership.evict(name, why)

    def _rounds(self) -> int:
        """Sync rounds server 0 has closed (0 in other modes)."""
        return int(getattr(self.engine.updater, "rounds", 0))

    def round_closed(self, round_no: int, contributors: list[str]) -> None:
        """Server 0's sync round closed: the others apply the same one (``FollowerSyncUpdater``).
        Runs under the updater's lock: only sends, never waits or takes the group's lock."""
        for peer in self._serving:
            try:
                fut = rpc.rpc_async(peer.name, peers.server_call, args=("sync_round", (round_no, contributors)),
                                    timeout=self.config.rpc_timeout)
                fut.add_done_callback(lambda f, p=peer: _log_failure(f, p, f"sync round {round_no}"))
            except RuntimeError as e:
                log.debug("could not send sync round %d to server %d: %s", round_no, peer.rank, e)

    def _roll_back(self, returning: Peer) -> dict | None:
        """(lock held) A lost server is back: every server to the newest complete checkpoint.
        The trainers still members are evicted first (their steps may have landed on some
        partitions only); with ``--reconnect`` they rejoin."""
        self._evict_trainers(f"server {returning.rank} was lost and every server goes back to the newest complete "
                             "checkpoint")
        self.from_memory = False
        step = self.policy.reload_latest()
        self.resume_step = step
        if self.on_rollback is not None:
            self.on_rollback()
        if step is None:
            log.warning("no complete checkpoint to go back to: server %d starts from the initial parameters while the "
                        "others keep theirs (give the servers --checkpoint-dir to restore a consistent state)",
                        returning.rank)
            return None
        resume = {"step": step, "run": self.policy.run_id}
        others = [p for p in self.peers.values() if p.state == "SERVING" and p is not returning]
        for peer, result in self._call_all(others, "load", (step, self.policy.run_id, self._rounds()),
                                           SAVE_TIMEOUT_S):
            if isinstance(result, BaseException):
                log.error("server %d could not load checkpoint step %d: %s", peer.rank, step, _first_line(result))
                self._lose(peer, f"it could not load checkpoint step {step}")
        log.warning("every server goes back to checkpoint step %d", step)
        return resume

    def stopping(self, rank: int) -> str:
        """A server process received SIGTERM: ``wait`` while server 0 itself stops (its final
        checkpoint needs every partition; it then stops the others), else ``go``: it is gone.
        Runs on an RPC thread: it may wait ``STOPPING_GRACE_S`` for server 0's own stop."""
        if self.stop_requested.wait(STOPPING_GRACE_S):
            return "wait"
        peer = self.peers.get(rank)
        if peer is not None:
            self._lose(peer, "it was stopped")
        return "go"

    # ---- the model a trainer brought (no --model) -------------------------------------------

    def give_model(self, layout: ModelLayout, values: list[torch.Tensor], reference: str | None,
                   args: dict) -> None:
        """Every other server process gets its pieces of the first trainer's model, under the
        plan the layout gives (``RuntimeError`` when one did not take them: the join fails, and
        server 0 holds no model until a trainer brings it again)."""
        plan = make_plan([e.numel for e in layout.parameters], self.config.num_servers)
        params = [v for v, e in zip(values, layout.entries, strict=True) if e.kind == PARAMETER]
        flats = plan.split([v.to(torch.float32) for v in params])
        with self.lock:
            live = [p for p in self.peers.values() if p.state == "SERVING"]
        calls = [(peer, (layout.to_dict(), reference, args, flats[peer.rank])) for peer in live]
        failed = []
        for peer, call_args in calls:  # one at a time: each carries only its own pieces
            result = self._call_all([peer], "adopt", call_args, self.config.rpc_timeout)[0][1]
            if isinstance(result, BaseException):
                failed.append((peer, result))
        if failed:
            peer, error = failed[0]
            raise RuntimeError(f"server {peer.rank} ({peer.name}) did not take its partition of the model: "
                               f"{_first_line(error)}")
        log.info("the other %d server process(es) hold their pieces of model %s (plan %s elements)", len(live),
                 reference, plan.elements_per_server())

    # ---- trainers ------------------------------------------------------------------------------

    def trainer_joined(self, request: JoinRequest, step: str) -> None:
        """Tell every server process about a trainer before it is answered (``RuntimeError``
        when one did not take it)."""
        optimizer = asdict(self.engine.optimizer_config) if self.engine.optimizer_config else None
        with self.lock:
            live = [p for p in self.peers.values() if p.state == "SERVING"]
        failed = [(p, r) for p, r in self._call_all(live, "trainer_joined", (request, step, optimizer),
                                                     self.config.rpc_timeout) if isinstance(r, BaseException)]
        if failed:
            peer, error = failed[0]
            raise RuntimeError(f"server {peer.rank} ({peer.name}) did not take the trainer: {_first_line(error)}")

    def trainer_gone(self, name: str) -> None:
        """Tell the other processes ``name`` left (after this process's engine forgot it), with
        what a follower of sync rounds needs to keep or drop its gradient: this reaches it by
        another call than the rounds' decisions, in either order (``FollowerSyncUpdater``)."""
        departure = getattr(self.engine.updater, "departure", None)
        rounds, in_round = departure(name) if departure is not None else (None, False)
        with self.lock:
            live = [p for p in self.peers.values() if p.state == "SERVING"]
        for peer in live:  # not waited for: a dead peer must not hold up membership
            try:
                fut = rpc.rpc_async(peer.name, peers.server_call, args=("trainer_gone", (name, rounds, in_round)),
                                    timeout=self.config.rpc_timeout)
                fut.add_done_callback(lambda f, p=peer: _log_failure(f, p, f"forgetting {name}"))
            except RuntimeError as e:
                log.debug("could not tell server %d that %s left: %s", peer.rank, name, e)

    # ---- checkpoints ---------------------------------------------------------------------------

    def save_partitions(self, step: int, run: str) -> None:
        """Every other server writes its partition of checkpoint ``step``; ``RuntimeError``
        when one is missing or fails (server 0 then writes nothing: the checkpoint is incomplete)."""
        with self.lock:
            missing = [p.rank for p in self.peers.values() if p.state != "SERVING"]
            live = [p for p in self.peers.values() if p.state == "SERVING"]
        if missing:
            raise RuntimeError(f"server(s) {', '.join(map(str, missing))} missing: checkpoint step {step} would be "
                               "incomplete")
        for peer, result in self._call_all(live, "save", (step, run), SAVE_TIMEOUT_S):
            if isinstance(result, BaseException):
                raise RuntimeError(f"server {peer.rank} did not write its partition of checkpoint step {step}: "
                                   f"{_first_line(result)}")

    # ---- versions for readers -------------------------------------------------------------------

    def model_version(self) -> tuple[int, dict[str, torch.Tensor]]:
        """A version of the whole model for readers (``psserver.server.versions``): every
        process's part copied at one global step (``psserver.server.engine.step_copies``), the
        parameters put together by the plan, the buffers server 0's. ``NoVersion`` when the
        processes share no step: updates applied as they arrive, a process missing, or no
        common step found in ``VERSION_TRIES``."""
        engine = self.engine
        if engine.layout is None or engine.plan is None:
            raise NoVersion("the server holds no model yet (the first trainer brings it)", later=True)
        if not self.config.rounds:
            raise NoVersion("reading the weights of a model spread over several server processes needs synchronous "
                            "updates (--update sync, or --update diloco --outer sync): applied as they arrive, "
                            "the processes hold no common step")
        with self.lock:
            missing = [p.rank for p in self.peers.values() if p.state != "SERVING"]
            live = sorted((p for p in self.peers.values() if p.state == "SERVING"), key=lambda p: p.rank)
        if missing or len(live) != self.config.num_servers - 1:
            raise NoVersion(f"server process(es) {', '.join(map(str, missing)) or 'not yet registered'} missing: no "
                            "whole version until they are back", later=True)
        for attempt in range(VERSION_TRIES):
            # The step now (every process is at it or about to be), then, if one had passed
            # it meanwhile, the next step: each copies its part as it applies it.
            step = engine.global_step + (attempt >= VERSION_TRIES // 2)
            own = engine.step_copies.at(step, PART_WAIT_S)
            if own is None:
                continue
            answers = self._call_all(live, "part_at", (step, PART_WAIT_S), PART_WAIT_S + PING_TIMEOUT_S)
            for peer, answer in answers:
                if isinstance(answer, BaseException):
                    raise NoVersion(f"server {peer.rank} did not give its part of step {step}: "
                                    f"{_first_line(answer)}", later=True)
            if all(answer is not None for _, answer in answers):
                return step, self._whole(own, [answer[0] for _, answer in answers])
        raise NoVersion(f"no step common to the {self.config.num_servers} server processes in {VERSION_TRIES} tries",
                        later=True)

    def _whole(self, own: tuple[torch.Tensor, torch.Tensor | None], others: list[torch.Tensor]) -> dict:
        """The model's ``state_dict`` from every process's parameters (server 0's first) and server 0's buffers."""
        engine = self.engine
        layout, plan = engine.layout, engine.plan
        params = iter(plan.gather([own[0], *others], [torch.empty(e.shape, device="meta") for e in layout.parameters]))
        buffers = [torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for e in layout.buffers]
        if buffers and own[1] is not None:
            unflatten_into(own[1], buffers)
        held = iter(buffers)
        values = [next(params).to(getattr(torch, e.dtype)) if e.kind == PARAMETER else next(held)
                  for e in layout.entries]
        return layout.state_dict(values)

    # ---- watching ------------------------------------------------------------------------------

    def start(self) -> None:
        peers.install(self)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and tell the other servers to stop (after server 0's final checkpoint)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self.lock:
            live = [p for p in self.peers.values() if p.state == "SERVING"]
        for peer, result in self._call_all(live, "shutdown", ("server 0 stopped",), 10.0):
            if isinstance(result, BaseException):
                log.warning("could not tell server %d to stop: %s", peer.rank, _first_line(result))
        peers.install(None)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_S):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the watch must outlive any one failure
                log.exception("watching the server processes failed")

    def poll(self) -> None:
        with self.lock:
            live = [p for p in self.peers.values() if p.state == "SERVING"]
        for peer, result in self._call_all(live, "status", (), PING_TIMEOUT_S):
            with self.lock:
                if peer.state != "SERVING":
                    continue
                if isinstance(result, BaseException):
                    peer.missed += 1
                    if peer.missed < MISSED_TO_LOSE:
                        continue
                    why = f"it did not answer {peer.missed} watches in a row ({_first_line(result)})"
                else:
                    peer.missed, peer.last_seen = 0, time.monotonic()
                    peer.updates, peer.parameter_bytes = int(result["updates"]), int(result["bytes"])
                    peer.tables = _tables(result)
                    continue
            self._lose(peer, why)

    def _ping(self, peer: Peer) -> bool:
        try:
            rpc.rpc_sync(peer.name, rendezvous.ping, timeout=PING_TIMEOUT_S)
            return True
        except RuntimeError:
            return False

    def _lose(self, peer: Peer, why: str) -> None:
        with self.lock:
            if peer.state != "SERVING":
                return
            peer.state = "LOST"
            self._serving = tuple(p for p in self.peers.values() if p.state == "SERVING")
            if self.membership is not None:
                self.membership.peers.discard(peer.name)
        log.error("server %d (%s on %s) lost: %s. The job's steps wait until it is back: restart it (with its state "
                  "in memory it continues from there; without, every server returns to the newest complete "
                  "checkpoint)", peer.rank, peer.name, peer.host, why)
        self.set_state(rendezvous.WAITING)
        if self.evict_worker is not None:
            self.evict_worker(peer.name, peer.rpc_id)

    def _call_all(self, targets: list[Peer], op: str, args: tuple, timeout: float) -> list[tuple[Peer, Any]]:
        """``op`` on every peer of ``targets`` at once; each peer with its result or its exception."""
        futures = []
        for peer in targets:
            try:
                futures.append((peer, rpc.rpc_async(peer.name, peers.server_call, args=(op, args), timeout=timeout)))
            except RuntimeError as e:  # it left the agent already
                futures.append((peer, e))
        out = []
        for peer, fut in futures:
            if isinstance(fut, BaseException):
                out.append((peer, fut))
                continue
            try:
                out.append((peer, fut.wait()))
            except (RuntimeError, concurrent.futures.TimeoutError) as e:
                out.append((peer, e))
        return out


def _tables(reply: dict[str, Any]) -> list[TableStatus]:
    """The tables of a peer's status reply (plain dicts: only those cross RPC), with the fields
    this version knows."""
    known = {f.name for f in fields(TableStatus)}
    return [TableStatus(**{k: v for k, v in t.items() if k in known}) for t in reply.get("tables", ())]


def _schedule_flags(d: dict[str, Any]) -> str:
    """A learning-rate schedule (``LRScheduleConfig`` fields) as the flags that give it."""
    return (f"--lr-schedule {d.get('name') or '(none)'} --lr-schedule-args '{json.dumps(d.get('args') or {})}' "
            f"--warmup-steps {d.get('warmup_steps', 0)}")


def _log_failure(fut, peer: Peer, what: str) -> None:
    try:
        fut.wait()
    except RuntimeError as e:
        log.debug("server %d: %s failed: %s", peer.rank, what, _first_line(e))


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if len(lines) >= 2 and lines[0].startswith("On WorkerInfo"):
        return lines[1][:300]
    return lines[0][:300] if lines else type(e).__name__

