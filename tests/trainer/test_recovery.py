"""A trainer's first join under ``--reconnect``: a server that goes away before it answers is
waited for (the join is tried again in a fresh process), not a one-line exit."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch.distributed as dist

from psserver.config import TrainerConfig
from psserver.errors import AdmissionUnanswered
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
