"""A trainer's first join under ``--reconnect``: a server that goes away before it answers is
waited for (the join is tried again in a fresh process), not a one-line exit; a store slow to
answer once is tried again."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch.distributed as dist

from psserver.config import TrainerConfig
from psserver.errors import AdmissionUnanswered, UsageError
from psserver.ps.rpc import rendezvous
from psserver.ps.rpc.rendezvous import request_admission
from psserver.trainer import recovery
from tests.procs import free_port


def test_an_admission_nobody_answers_is_its_own_error():
    store = dist.TCPStore("127.0.0.1", free_port(), None, True, datetime.timedelta(seconds=5))
    with pytest.raises(AdmissionUnanswered, match=r"did not answer the join of rank 3 within 0.3s"):
        request_admission(store, 3, "here:1", timeout=0.3)


def test_a_first_join_whose_server_went_away_rejoins_under_reconnect(monkeypatch):
    """Seen in the soak test: the server SIGKILLed between a trainer's request for room and its
    answer; the trainer exited 2 although it had ``--reconnect``."""
    lost = AdmissionUnanswered("the psserver at here:1 went away while it admitted rank 1 (Connection reset)")

    def session(*args, **kwargs):
        raise lost

    class Reexec(Exception):
        pass

    positions = []

    def reexec(position, stop, argv=None):  # noqa: ARG001
        positions.append(position)
        raise Reexec

    monkeypatch.setattr(recovery, "Session", session)
    monkeypatch.setattr(recovery, "reexec", reexec)
    config = TrainerConfig(rank=1, reconnect=True)
    with pytest.raises(Reexec):
        recovery.join(config, None, None)
    assert len(positions) == 1 and positions[0].steps == 0
    with pytest.raises(AdmissionUnanswered):  # without --reconnect: its one line, as before
        recovery.join(dataclasses.replace(config, reconnect=False), None, None)


class _DeadStore:
    """A store whose server died after the connection: every call fails as torch's does."""

    def add(self, key, value):
        raise dist.DistNetworkError("Connection reset by peer")

    set = add


def test_a_server_that_dies_before_its_store_takes_the_request_is_an_unanswered_admission():
    """Seen in the soak test: the store's ``add`` reset mid-join became an internal error."""
    with pytest.raises(AdmissionUnanswered, match=r"went away before it admitted rank 3 \(Connection reset"):
        request_admission(_DeadStore(), 3, "here:1")


def test_one_silent_handshake_is_tried_again_two_are_a_usage_error(monkeypatch):
    """A store on a busy machine may miss one handshake window; a port silent twice is not a psserver's."""
    server = dist.TCPStore("127.0.0.1", free_port(), None, True, datetime.timedelta(seconds=5))
    real, answers = rendezvous._store_client, []

    def client(host, port, timeout):
        answers.append(len(answers) >= 1)  # the first try is silent
        return real(host, port, timeout) if answers[-1] else None

    monkeypatch.setattr(rendezvous, "_store_client", client)
    monkeypatch.setattr(rendezvous, "_wait_until_serving", lambda *a, **k: None)
    _, url = rendezvous.connect_store("127.0.0.1", server.port, 10.0, 5.0)
    rendezvous.forget_store(url)
    assert answers == [False, True]
    monkeypatch.setattr(rendezvous, "_store_client", lambda *a: None)
    with pytest.raises(UsageError, match="never answered the rendezvous handshake"):
        rendezvous.connect_store("127.0.0.1", server.port, 10.0, 5.0)
