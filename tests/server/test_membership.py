"""The membership janitor without RPC: which RPC workers that are no psserver members it evicts
(the dead ones, after a grace) and which it leaves alone (a join the server is handling, a
worker that answers on its way to ``join``). The agent and its store are fakes; the real
thing is in tests/end_to_end/test_failures.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from psserver.common.torch_rpc import ALL_WORKERS_KEY
from psserver.server import membership as membership_module
from psserver.server.membership import ALIVE, DEAD, STRANGER_LIMIT_S, Member, Membership
from psserver.telemetry import TrainerStatus

TIMEOUT = 5.0


class Store:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value


class Agent:
    """Knows ``workers`` (name -> RPC id); its store lists them as torch's registry does."""

    def __init__(self, workers: dict[str, int]) -> None:
        self.workers = dict(workers)
        self.store = Store()
        self.store.set(ALL_WORKERS_KEY, "".join(f"{n}-{i}," for n, i in workers.items()))

    def get_worker_infos(self) -> list:
        return [SimpleNamespace(name=n, id=i) for n, i in self.workers.items()]


@pytest.fixture
def group(monkeypatch):
    """A server's membership in a group of the server and trainer ``t_1`` (not a member), whose
    pings answer ``group.answers[name]``; evictions are recorded in ``group.evicted``."""
    agent = Agent({"psserver": 0, "t_1": 1})
    monkeypatch.setattr(membership_module.torch_rpc, "current_agent", lambda: agent)
    m = Membership(agent.store, TIMEOUT, on_gone=lambda *a: None)
    m.answers = {"t_1": ALIVE}
    m.pinged = []
    m.evicted = []

    def ping(names):
        m.pinged.extend(names)
        return {n: (m.answers[n], "") for n in names}

    monkeypatch.setattr(m, "_ping", ping)
    monkeypatch.setattr(m, "_evict", lambda name, wid: m.evicted.append((name, wid)))
    m.agent = agent
    return m


def _age(m: Membership, name: str, seconds: float) -> None:
    """Make ``name`` a stranger first seen ``seconds`` ago."""
    m._janitor()
    m._strangers[name] -= seconds


def test_a_dead_stranger_is_evicted_after_the_grace_and_not_before(group):
    group.answers["t_1"] = DEAD
    group._janitor()
    assert group.evicted == [] and group.pinged == []  # within the grace: not even asked
    _age(group, "t_1", TIMEOUT + 1)
    group._janitor()
    assert group.evicted == [("t_1", 1)]


def test_a_trainer_whose_join_the_server_handles_is_no_stranger(group):
    # it took the grace to call join (a loaded host), and the join then waits on the other server
    # processes (their first optimizer): it is no stranger while the server handles that call
    group.answers["t_1"] = DEAD
    _age(group, "t_1", TIMEOUT + 1)
    with group.joining("t_1"):
        group._janitor()
        assert group.evicted == [] and "t_1" not in group._strangers
    assert "t_1" not in group._joining


def test_a_stranger_that_answers_is_waited_for_up_to_the_limit(group, caplog):
    _age(group, "t_1", TIMEOUT + 1)
    with caplog.at_level("INFO", logger=membership_module.__name__):
        group._janitor()
        group._janitor()
    assert group.pinged == ["t_1", "t_1"] and group.evicted == []  # a loaded host: on its way to join
    assert len([r for r in caplog.records if "waiting for it" in r.message]) == 1  # said once
    _age(group, "t_1", STRANGER_LIMIT_S)
    group._janitor()
    assert group.evicted == [("t_1", 1)]  # in the group, answering, never joining


def test_a_worker_only_the_store_lists_is_evicted_after_the_grace_without_a_ping(group):
    # it died inside init_rpc: the server's agent never learned it
    group.agent.workers.pop("t_1")
    _age(group, "t_1", TIMEOUT + 1)
    group._janitor()
    assert group.pinged == [] and group.evicted == [("t_1", 1)]


def test_a_worker_inside_its_init_rpc_is_no_stranger_while_its_join_holds_the_token(group):
    # a server process restarted on a loaded host: the store lists it, the agent does not yet
    group.agent.workers.pop("t_1")
    group.agent.store.set(membership_module.TOKEN_KEY, b"Token_for_t_1_join")
    _age(group, "t_1", TIMEOUT + 1)
    group._janitor()
    assert group.evicted == [] and group._strangers["t_1"] > time.monotonic() - 1  # its grace starts again
    group.agent.store.set(membership_module.TOKEN_KEY, b"")  # the token's own grace freed it: it died
    _age(group, "t_1", TIMEOUT + 1)
    group._janitor()
    assert group.evicted == [("t_1", 1)]


def test_room_for_a_join_evicts_the_dead_trainers_and_keeps_the_live(group, monkeypatch):
    # init_rpc calls every member: one that exited (ECONNREFUSED) fails a server process's join
    for name, rank in (("t_1", 0), ("t_2", 1), ("t_3", 2)):
        group.members[name] = Member(TrainerStatus(rank, name, "h", 0.0, 0.0), rank + 1, "chained")
    group.answers.update(t_1=ALIVE, t_2=DEAD, t_3=ALIVE)
    gone = []
    monkeypatch.setattr(group, "evict", lambda name, reason: gone.append((name, reason)))
    assert group.make_room(None, "server process 1 asked to join") is None
    assert [n for n, _ in gone] == ["t_2"] and "server process 1 asked to join" in gone[0][1]
    assert group.make_room(2, "a trainer asked for rank 2") == "t_3"  # the live holder of the rank


def test_members_and_peers_are_never_strangers(group):
    group.agent.workers["psserver_1"] = 2
    group.agent.store.set(ALL_WORKERS_KEY, "psserver-0,t_1-1,psserver_1-2,")
    group.peers.add("psserver_1")
    group.members["t_1"] = Member(TrainerStatus(0, "t_1", "h", 0.0, 0.0), 1, "chained")  # join() needs RPC
    group._janitor()
    assert group._strangers == {}


def test_a_stranger_slow_to_answer_its_ping_delays_no_heartbeat_check(group):
    # the janitor's ping of an overdue stranger waits up to its timeout: the heartbeat check
    # runs on a thread of its own, so a silent trainer is still LOST a timeout after its last beat
    released = threading.Event()

    def slow_ping(names):
        released.wait(10)  # a stranger that does not answer (the real ping gives up after 2 s)
        return dict.fromkeys(names, (DEAD, ""))

    group._ping = slow_ping
    group.timeout = 0.5
    group._strangers["t_1"] = time.monotonic() - 10 * TIMEOUT  # overdue from the first pass
    group.members["t_2"] = Member(TrainerStatus(1, "t_2", "h", 0.0, 0.0), 2, "pushpull")  # never beats
    t0 = time.monotonic()
    group.start()
    try:
        while group.is_member("t_2") and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        took = time.monotonic() - t0
    finally:
        released.set()
        group.stop()
    assert not group.is_member("t_2") and took < 3.0, took  # 0.5 s timeout; the ping held the janitor 10 s
    assert ("t_1", 1) in group.evicted
