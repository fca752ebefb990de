"""Who is in the group, who is alive, and cleaning up after those who are not.

PyTorch's dynamic RPC groups leave failures to the user: a dead worker stays a
member forever, a join that dies holding the group's membership token blocks every later
join, leave and the server's own shutdown. The server fixes both here: heartbeats find dead
or hung trainers, eviction removes them from the group (the store, the other trainers' view;
the server's own agent keeps their address, see ``Membership._evict``), and a janitor frees a
membership token whose holder is gone.

A join cannot wait for the heartbeats: ``init_rpc`` calls every member, and a trainer
restarted at once after a crash (Kubernetes restarts a failed pod of an Indexed Job with the
same index) finds its dead predecessor still a member. So a joining trainer first asks the
server to make room (``rendezvous.request_admission``, through the store and the admission
desk, ``psserver.server.admission``, which asks :meth:`Membership.admit`): the server pings
its members, evicts those whose pipe is broken, and the rank's holder if it does not answer in
a couple of seconds; a holder that answers keeps its rank.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch.distributed.rpc as rpc

from psserver.common import torch_rpc
from psserver.common.messages import Report
from psserver.common.rendezvous import ADMITTED, SERVER_NAME, is_trainer_name, ping
from psserver.common.torch_rpc import ALL_WORKERS_KEY, TOKEN_KEY, worker_key
from psserver.errors import JoinLater, first_line
from psserver.telemetry import TrainerStatus

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 2.0
"""How long a rank's holder has to answer when another trainer asks for its rank."""
STRANGER_LIMIT_S = 60.0
"""How long an RPC worker that answers pings may stay in the group without joining psserver
(a trainer's ``join`` call, sent once ``init_rpc`` returns, times out after its own 60 s)."""
JANITOR_PERIOD_S = 0.5
"""How often the janitor looks for strangers and a token whose holder died (its grace periods
are seconds long)."""
ALIVE, DEAD, SILENT = "alive", "dead", "silent"
"""What a ping finds: an answer; a broken pipe or a worker the agent no longer knows; no answer."""


@dataclass
class Member:
    status: TrainerStatus
    rpc_id: int
    protocol: str
    """The step protocol this trainer joined with."""
    last_seen_mono: float = field(default_factory=time.monotonic)
    report: Report | None = None
    """The last report it sent (where it is in its data: what a successor of its rank continues from)."""


class Membership:
    """``on_gone(member, state, evicted)`` runs once per trainer that leaves (LEFT) or is lost
    (LOST), before an evicted one is removed from the RPC group."""

    def __init__(
        self,
        store,
        timeout: float,
        on_gone: Callable[[Member, str, bool], None],
    ) -> None:
        self.store = store
        self.timeout = timeout
        self.on_gone = on_gone
        self._retired: set[str] = set()
        """Evicted trainers this RPC agent still knows (see ``_evict``): not members, not strangers."""
        self.lock = threading.Lock()
        self.members: dict[str, Member] = {}
        self.history: list[TrainerStatus] = []  # trainers that left or were lost (bounded)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._token_seen: tuple[bytes, float] | None = None
        self._strangers: dict[str, float] = {}  # RPC workers that never called join()
        self._answered: set[str] = set()  # strangers past the grace that answer: logged once
        self._joining: set[str] = set()
        """Trainers whose ``join`` call the server is handling: not strangers, however long it takes."""
        self.peers: set[str] = set()
        """RPC names of the other server processes (``--num-servers``): members of the RPC
        group that are not trainers, never evicted as strangers."""

    # ---- joins, leaves, heartbeats -------------------------------------------------------

    @contextlib.contextmanager
    def joining(self, name: str) -> Iterator[None]:
        """While the server handles ``name``'s join call: a join that waits (on another server
        process's first optimizer, on a loaded host) is no stranger to evict."""
        with self.lock:
            self._joining.add(name)
        try:
            yield
        finally:
            with self.lock:
                self._joining.discard(name)

    def join(self, rank: int, name: str, host: str, protocol: str, transport: dict | None = None) -> None:
        """Make ``name`` a member as ``rank``. The rank's holder keeps it while it answers a ping
        (``ValueError``); one that does not is evicted first."""
        info = _worker_info(name)
        for _ in range(3):  # a holder evicted here is replaced by no one else but a racing join
            now = time.time()
            with self.lock:
                old = self._live_name(rank)
                if old is None or old == name:
                    status = TrainerStatus(rank, name, host, now, now, step=protocol)
                    if transport is not None:  # trainer compute: the path its buffers take, and why
                        status.transport, status.transport_reason = transport["kind"], transport["reason"]
                    self.members[name] = Member(status, info.id, protocol)
                    break
            if not self._evict_unless_alive(old, rank, name):
                raise ValueError(f"rank {rank} is already taken by live trainer {old}")
        else:
            raise JoinLater(f"rank {rank} is contended by several joins at once: try again")
        via = f", transport {transport['kind']}: {transport['reason']}" if transport else ""
        log.info("trainer %s (rank %d) joined from %s%s; RPC members: %s", name, rank, host, via, self.rpc_members())

    def admit(self, rank: int) -> str:
        """Make room for a join of ``rank`` before it joins the RPC group: ``ADMITTED``, or why not.

        ``init_rpc`` calls every member, so every member is pinged first: those whose pipe is
        broken are evicted, and so is the rank's holder if it does not answer (it learns of its
        eviction on its next call). A member of another rank that is only slow to answer is left
        alone: its heartbeats decide.
        """
        holder = self.make_room(rank, f"a trainer asked for rank {rank}")
        if holder is None:
            return ADMITTED
        log.warning("refused a join of rank %d: its holder %s is alive", rank, holder)
        return f"rank {rank} is already taken by live trainer {holder}"

    def make_room(self, rank: int | None, why: str) -> str | None:
        """Ping every trainer before a join; evict those whose pipe is broken (a joiner's
        ``init_rpc`` would fail on them with ECONNREFUSED) and the holder of ``rank`` unless it
        answers. The live holder of ``rank``, if any (None for a server process's join)."""
        with self.lock:
            ranks = {name: m.status.rank for name, m in self.members.items()}
        holder = None
        for name, (state, detail) in self._ping(list(ranks)).items():
            if state == ALIVE:
                holder = name if ranks[name] == rank else holder
            elif state == DEAD or ranks[name] == rank:
                self.evict(name, _eviction_reason(state, detail, why))
            else:
                log.warning("trainer %s did not answer a ping within %s: a join may wait for it", name, detail)
        return holder

    def _evict_unless_alive(self, name: str, rank: int, joiner: str) -> bool:
        """Ping ``name``, the holder of the rank ``joiner`` asks for; evict it unless it answers
        (True: it was evicted)."""
        state, detail = self._ping([name])[name]
        if state == ALIVE:
            return False
        self.evict(name, _eviction_reason(state, detail, f"{joiner} asked for rank {rank}"))
        return True

    @property
    def ping_timeout(self) -> float:
        return min(PING_TIMEOUT_S, self.timeout)

    def _ping(self, names: list[str]) -> dict[str, tuple[str, str]]:
        """Ask ``names`` whether they are alive, all at once: ``(ALIVE | DEAD | SILENT, detail)``."""
        timeout = self.ping_timeout
        t0 = time.monotonic()
        out: dict[str, tuple[str, str]] = {}
        futures = {}
        done_at: dict[str, float] = {}
        for name in names:
            try:
                fut = rpc.rpc_async(name, ping, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - a worker the agent does not know (any more)
                out[name] = (DEAD, first_line(e))
                continue
            fut.add_done_callback(lambda _, n=name: done_at.setdefault(n, time.monotonic()))
            futures[name] = fut
        for name, fut in futures.items():
            try:
                fut.wait()
                out[name] = (ALIVE, "")
            except Exception as e:  # noqa: BLE001 - any failure is an answer here
                # Torch says "timeout" only in free text: the time the failure took tells instead.
                took = done_at.get(name, time.monotonic()) - t0
                out[name] = (SILENT, f"{timeout:g}s") if took >= 0.9 * timeout else (DEAD, first_line(e))
        return out

    def _live_name(self, rank: int) -> str | None:
        for name, m in self.members.items():
            if m.status.rank == rank:
                return name
        return None

    def seen(self, name: str) -> Member:
        """Record a sign of life; ``KeyError`` for a trainer that is not a member."""
        with self.lock:
            m = self.members[name]
            m.last_seen_mono = time.monotonic()
            m.status.last_seen = time.time()
            return m

    def names(self) -> list[str]:
        """The live members' RPC names."""
        with self.lock:
            return list(self.members)

    def is_member(self, name: str) -> bool:
        with self.lock:
            return name in self.members

    def leave(self, name: str) -> None:
        self._remove(name, "LEFT", evict=False)

    def evict(self, name: str, reason: str) -> None:
        """Evict a live trainer the server will not keep (``reason`` shows in its status)."""
        with self.lock:
            m = self.members.get(name)
            if m is None:
                return
            m.status.reason = reason
        log.warning("evicting trainer %s: %s", name, reason)
        self._remove(name, "LOST", evict=True)

    def snapshot(self) -> list[TrainerStatus]:
        with self.lock:
            current = [m.status for m in self.members.values()]
            return [*self.history, *current]

    def on_host(self, host: str) -> int:
        """Live trainers that joined from ``host``."""
        with self.lock:
            return sum(1 for m in self.members.values() if m.status.host == host)

    def active_count(self) -> int:
        with self.lock:
            return len(self.members)

    def mean_loss(self) -> float | None:
        """Mean of the live trainers' last reported losses (None before any)."""
        with self.lock:
            losses = [m.status.last_loss for m in self.members.values() if math.isfinite(m.status.last_loss)]
        return sum(losses) / len(losses) if losses else None

    def remove_all(self) -> None:
        """The server is stopping: every member is removed from the group."""
        with self.lock:
            names = list(self.members)
        for name in names:
            self._remove(name, "LEFT", evict=True)

    # ---- failure handling ----------------------------------------------------------------

    def start(self) -> None:
        """The heartbeat check and the janitor, on threads of their own: the janitor pings
        strangers and calls the store, which may take a ping's timeout, and a heartbeat
        check that waited for it would mark trainers LOST that late."""
        period = max(0.05, min(0.5, self.timeout / 5))
        self._threads = [
            threading.Thread(target=self._every, args=(period, self._check_heartbeats), name="psserver-membership",
                             daemon=True),
            threading.Thread(target=self._every, args=(max(period, JANITOR_PERIOD_S), self._janitor),
                             name="psserver-janitor", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def _every(self, period: float, work: Callable[[], None]) -> None:
        while not self._stop.wait(period):
            try:
                work()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failure
                log.exception("membership monitor error")

    def _check_heartbeats(self) -> None:
        """Mark LOST (and evict) every member not heard from for longer than the timeout."""
        now = time.monotonic()
        with self.lock:
            stale = [n for n, m in self.members.items() if now - m.last_seen_mono > self.timeout]
        for name in stale:
            log.warning("trainer %s missed heartbeats for %.1fs: marking it LOST", name, self.timeout)
            self._remove(name, "LOST", evict=True)

    def _remove(self, name: str, state: str, *, evict: bool) -> None:
        with self.lock:
            m = self.members.pop(name, None)
            if m is None:
                return
            m.status.state = state
            self.history.append(m.status)
            del self.history[:-256]
        rank = m.status.rank
        # Before an eviction: what the trainer holds (autograd contexts) is released while
        # the agent still knows it.
        self.on_gone(m, state, evict)
        if evict:
            self._evict(name, m.rpc_id)
        else:
            # A clean leave unregisters the name but leaves names/<id> behind: drop it so the
            # store holds live workers only.
            try:
                _delete_if(torch_rpc.current_agent().store, worker_key(m.rpc_id), name)
            except Exception:  # noqa: BLE001
                log.debug("cannot free RPC id of %s", name, exc_info=True)
        if state == "LEFT":
            log.info("trainer %s (rank %d) left after %d steps", name, rank, m.status.steps)

    def evict_worker(self, name: str, rpc_id: int) -> None:
        """Remove a dead RPC worker that is no trainer (a lost server process) from the group."""
        self._evict(name, rpc_id)

    def _evict(self, name: str, rpc_id: int) -> None:
        """Remove a dead worker from the RPC group so later joins do not try to reach it."""
        agent = torch_rpc.current_agent()
        try:
            info = agent.get_worker_info(name)
        except Exception:  # noqa: BLE001 - it left the agent on its own meanwhile
            info = None
        if info is not None and info.id == rpc_id and not self._is_retired(name):
            if is_trainer_name(name):
                # This agent and the other server processes keep knowing a dead trainer. torch
                # retries its RRef messages to it (the acceptance of an RRef the trainer passed
                # back, sent at every step of the plain protocol) with a growing backoff for as
                # long as the process lives, and each retry addresses the worker by a reference
                # into the agent's map: a trainer removed from that map makes the next retry
                # read freed memory, and the server die of SIGSEGV (seen once the evicted trainer,
                # SIGSTOPped, was SIGKILLed). A trainer name is never used twice, and the store no
                # longer lists it, so no join reaches it; what is kept is a name and an address.
                with self.lock:
                    self._retired.add(name)
            else:  # a server process comes back under its own name: it must leave the map
                torch_rpc.remove_worker(agent, info)
            # Live trainers still list the dead one; their own leave would try to reach it.
            # Tell them, exactly as a worker leaving cleanly would have.
            for other in agent.get_worker_infos():
                if is_trainer_name(other.name) and other.name != name and not self._is_retired(other.name):
                    torch_rpc.tell_worker_removed(other, info)
        rpc_store = agent.store
        try:
            if rpc_store.check([ALL_WORKERS_KEY]):
                workers = rpc_store.get(ALL_WORKERS_KEY).decode()
                rpc_store.set(ALL_WORKERS_KEY, workers.replace(f"{name}-{rpc_id},", ""))
            _delete_if(rpc_store, worker_key(rpc_id), name)
        except Exception:  # noqa: BLE001
            log.warning("could not remove %s from the RPC store", name, exc_info=True)
        log.info("evicted %s from the RPC group; RPC members: %s", name, self.rpc_members())

    def _is_retired(self, name: str) -> bool:
        with self.lock:
            return name in self._retired

    def rpc_members(self) -> str:
        """The RPC group's live members, as this server sees them (evicted ones excluded)."""
        with self.lock:
            retired = set(self._retired)
        agent = torch_rpc.current_agent()
        return ",".join(sorted(w.name for w in agent.get_worker_infos() if w.name not in retired))

    def _janitor(self) -> None:
        """Free the group's membership token when its holder died holding it, and evict RPC
        workers that finished ``init_rpc`` but never joined psserver (killed in between)."""
        agent = torch_rpc.current_agent()
        now = time.monotonic()
        with self.lock:
            known = set(self.members) | self._joining
            retired = set(self._retired)
        rpc_store = agent.store
        token = rpc_store.get(TOKEN_KEY) if rpc_store.check([TOKEN_KEY]) else b""
        in_agent = {w.name: w.id for w in agent.get_worker_infos() if w.name not in retired}
        workers = {**in_agent, **dict(_registered_workers(rpc_store))}
        overdue = {}
        for name, wid in workers.items():
            if name == SERVER_NAME or name in known or name in self.peers:
                self._strangers.pop(name, None)
                self._answered.discard(name)
                continue
            # Registered with RPC but not a psserver member: a join killed before it called
            # join(), or a leave that failed half-way. Give it time to finish, then clean up
            # (one that answers pings gets up to STRANGER_LIMIT_S: _evict_strangers).
            first = self._strangers.setdefault(name, now)
            if token == _token_of(name, "join"):  # inside its init_rpc: the token's own grace decides
                self._strangers[name] = now
                continue
            if now - first > max(self.timeout, 5.0):
                overdue[name] = wid
        self._evict_strangers(overdue, in_agent, now)
        self._release_token(rpc_store, token, now)

    def _evict_strangers(self, overdue: dict[str, int], in_agent: dict[str, int], now: float) -> None:
        """Evict the overdue strangers that are dead; one that answers a ping is a trainer on its
        way to ``join`` (a loaded host), given up to :data:`STRANGER_LIMIT_S`. One that only the
        store lists died inside ``init_rpc``, or is still there: its entry would fail every later
        join that calls it once the token is freed, so it goes."""
        pings = self._ping([n for n in overdue if n in in_agent]) if overdue else {}
        for name, wid in overdue.items():
            state, _ = pings.get(name, (DEAD, "not in this server's group"))
            waited = now - self._strangers[name]
            if state == ALIVE and waited < STRANGER_LIMIT_S:
                if name not in self._answered:
                    self._answered.add(name)
                    log.info("RPC worker %s has not joined psserver %.0fs after joining the RPC group, and answers: "
                             "waiting for it", name, waited)
                continue
            log.warning("RPC worker %s is not a live psserver member (%s %.0fs): evicting it", name,
                        "answering but not joined after" if state == ALIVE else "not answering, registered",
                        waited)
            self._strangers.pop(name, None)
            self._answered.discard(name)
            self._evict(name, wid)

    def _release_token(self, rpc_store, token: bytes, now: float) -> None:
        """Free the membership token when its holder has held it too long (died holding it)."""
        if not token:
            self._token_seen = None
            return
        if self._token_seen is None or self._token_seen[0] != token:
            self._token_seen = (token, now)
            return
        if now - self._token_seen[1] < max(self.timeout, 10.0):
            return
        holder = token.decode()
        log.warning("membership token held by %s for %.1fs: releasing it", holder, now - self._token_seen[1])
        rpc_store.compare_set(TOKEN_KEY, token, b"")
        rpc_store.set(holder, "Done")  # wakes joiners waiting on the holder's key
        self._token_seen = None


def _token_of(name: str, what: str) -> bytes:
    """The membership token a worker's ``init_rpc`` (``join``) or ``shutdown`` (``leave``) holds."""
    return f"Token_for_{name}_{what}".encode()


def _eviction_reason(state: str, detail: str, why: str) -> str:
    if state == SILENT:
        return f"it did not answer a ping within {detail} when {why}"
    return f"its RPC connection is broken ({detail}) and {why}"


def _delete_if(store, key: str, value: str) -> None:
    """Delete ``key`` only while it still holds ``value`` (never another worker's entry)."""
    if store.check([key]) and store.get(key) == value.encode():
        store.delete_key(key)


def _registered_workers(rpc_store) -> list[tuple[str, int]]:
    if not rpc_store.check([ALL_WORKERS_KEY]):
        return []
    out = []
    for item in rpc_store.get(ALL_WORKERS_KEY).decode().split(","):
        if item:
            name, _, wid = item.rpartition("-")
            out.append((name, int(wid)))
    return out


WORKER_INFO_WAIT_S = 2.0
"""How long a join waits for the server's RPC agent to learn the joining worker (the group's
update and the join are handled on different RPC threads; seen once under store tampering)."""


def _worker_info(name: str):
    deadline = time.monotonic() + WORKER_INFO_WAIT_S
    while True:
        try:
            return rpc.get_worker_info(name)
        except RuntimeError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)
