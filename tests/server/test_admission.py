"""The admission desk and the job's store namespace, on an in-process store (no RPC).

What a stranger can write to the store must not decide anything: RPC ids and incarnations
come from the server's memory, a counter that jumps or holds garbage is followed or reset,
requests are bounded, and keys the server published are put back.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from psserver.common import rendezvous
from psserver.common.rendezvous import (
    ADMITTED,
    KEY_ADMIT_ANSWER,
    KEY_ADMIT_REQUEST,
    KEY_ADMIT_SEQ,
    namespace,
    scoped,
)
from psserver.server import admission
from psserver.server.admission import AdmissionDesk, PublishedKeys


def announce(store, rank) -> int:
    seq = int(store.add(KEY_ADMIT_SEQ, 1))
    store.set(KEY_ADMIT_REQUEST.format(seq=seq), str(rank))
    return seq


def answer(store, seq) -> str:
    return store.get(KEY_ADMIT_ANSWER.format(seq=seq)).decode()


@pytest.fixture
def store():
    return dist.HashStore()


@pytest.fixture
def desk(store):
    decisions: dict[int, str] = {}
    d = AdmissionDesk(store, lambda rank: decisions.get(rank, ADMITTED), PublishedKeys())
    d.decisions = decisions
    return d


def test_ids_and_incarnations_come_from_the_server(store, desk):
    seqs = [announce(store, r) for r in (0, 1, 0)]
    desk.poll()
    assert [answer(store, s) for s in seqs] == [f"{ADMITTED} 1 1", f"{ADMITTED} 2 1", f"{ADMITTED} 3 2"]
    desk.decisions[1] = "rank 1 is already taken by live trainer trainer_1_1"
    refused = announce(store, 1)
    desk.poll()
    assert answer(store, refused) == "rank 1 is already taken by live trainer trainer_1_1"
    assert not store.check([KEY_ADMIT_REQUEST.format(seq=refused)])  # answered requests are removed


def test_a_counter_written_by_a_stranger_neither_stalls_nor_refuses_joins(store, desk):
    store.set("psserver/next_rpc_id", "65535")  # the old counter: read by no one
    store.add(KEY_ADMIT_SEQ, 10**9)  # a jump: the desk looks at the last MAX_BACKLOG numbers only
    desk.poll()
    seq = announce(store, 0)
    desk.poll()
    assert answer(store, seq) == f"{ADMITTED} 1 1"
    store.set(KEY_ADMIT_SEQ, "not a number")
    desk.poll()  # reset to what the desk handled
    seq = announce(store, 1)
    desk.poll()
    assert answer(store, seq) == f"{ADMITTED} 2 1"
    store.set(KEY_ADMIT_SEQ, "3")  # back in time: followed
    desk.poll()
    seq = announce(store, 2)
    desk.poll()
    assert answer(store, seq) == f"{ADMITTED} 3 1"


def test_an_unwritten_announcement_is_skipped_without_holding_up_the_next(store, desk, monkeypatch):
    monkeypatch.setattr(admission, "UNWRITTEN_S", 0.0)
    store.add(KEY_ADMIT_SEQ, 1)  # announced, never written (its trainer died)
    seq = announce(store, 4)
    desk.poll()
    assert answer(store, seq) == f"{ADMITTED} 1 1"
    desk.poll()
    seq = announce(store, 5)
    desk.poll()
    assert answer(store, seq) == f"{ADMITTED} 2 1"


@pytest.mark.parametrize("request_value,expected", [
    ("x" * 8 * 1024 * 1024, "malformed join request"),
    ("seven", "malformed join request"),
    ("-3", "rank -3 is out of range"),
])
def test_requests_are_bounded(store, desk, request_value, expected):
    seq = int(store.add(KEY_ADMIT_SEQ, 1))
    store.set(KEY_ADMIT_REQUEST.format(seq=seq), request_value)
    desk.poll()
    reply = answer(store, seq)
    assert reply.startswith(expected) and len(reply) < 100


def test_published_keys_are_put_back(store):
    published = PublishedKeys()
    published.set(store, rendezvous.KEY_SERVER_STATE, rendezvous.SERVING)
    store.set(rendezvous.KEY_SERVER_STATE, rendezvous.STARTING)
    published.repair()
    assert store.get(rendezvous.KEY_SERVER_STATE) == b"SERVING"
    store.delete_key(rendezvous.KEY_SERVER_STATE)
    published.repair()
    assert store.get(rendezvous.KEY_SERVER_STATE) == b"SERVING" and published.repaired == 2


def test_the_namespace_hides_the_jobs_keys(store):
    assert namespace(None) == "" and scoped(store, None) is store
    assert namespace("token-a") != namespace("token-b") and "token-a" not in namespace("token-a")
    job = scoped(store, "secret")
    job.set(rendezvous.KEY_SERVER_STATE, rendezvous.SERVING)
    assert not store.check([rendezvous.KEY_SERVER_STATE])  # a stranger's name for it finds nothing
    store.set(rendezvous.KEY_SERVER_STATE, rendezvous.STARTING)  # and its write changes nothing
    assert job.get(rendezvous.KEY_SERVER_STATE) == b"SERVING"
    assert not scoped(store, "wrong").check([rendezvous.KEY_SERVER_STATE])
