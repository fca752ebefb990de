"""A server started again (from an older checkpoint) serves lower steps under another history:
readers, shared copies and relays take its newest at once, and never keep serving the old
process's weights as the newest."""

from __future__ import annotations

import time

import pytest
import torch

from psserver.common import version_files
from psserver.config.control import ControlConfig
from psserver.control.server import ControlServer
from psserver.errors import ServerUnavailable, UsageError
from psserver.reader.reader import Reader, Version
from psserver.reader.relay import Relay
from tests.control.fakes import Trained


def wait_through_the_restart(reader: Reader, newer_than: int) -> Version | None:
    """``reader.wait``, asked again while the server is out of reach (as ``subscribe`` does)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return reader.wait(newer_than, timeout=10)
        except ServerUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def at_step(n: int) -> Trained:
    trained = Trained()
    for _ in range(n):
        trained.train_one()
    return trained


def test_readers_copies_and_relays_follow_a_server_started_again_at_a_lower_step(target, tmp_path, monkeypatch):
    monkeypatch.setattr(version_files, "root", lambda: tmp_path / "readers")
    first = at_step(5)
    server = ControlServer(target, ControlConfig(port=0), grace=0.5, weights=first.versions).start()
    address = server.address
    readers = {"alone": Reader(address, timeout=10), "shared": Reader(address, timeout=10, share=True)}
    try:
        with Relay(address, name="relay") as relay:
            readers["behind a relay"] = Reader(relay.address, timeout=10)
            held = {name: r.latest() for name, r in readers.items()}
            assert {name: v.step for name, v in held.items()} == dict.fromkeys(readers, 5)
            subscriber = Reader(address, timeout=2)
            readers["subscribed"] = subscriber
            subscription = subscriber.subscribe(timeout=30)
            assert next(subscription).step == 5
            server.stop(grace=0.1)
            second = at_step(2)
            server = ControlServer(target, ControlConfig(port=server.port), grace=0.5, weights=second.versions).start()
            newer = next(subscription)  # rides out the server's absence: asked again every second
            assert (newer.step, newer.history) == (2, second.versions.history)
            for name, reader in readers.items():
                if reader is subscriber:
                    continue
                newer = wait_through_the_restart(reader, 5)
                assert newer is not None, f"{name}: waits past step 5 of a history gone"
                assert newer.step == 2 and newer.history == second.versions.history != held[name].history, name
                assert torch.equal(newer.state["weight"], torch.full((200, 300), 2.0)), name
                assert reader.latest().step == 2, name
    finally:
        for reader in readers.values():
            reader.close()
        server.stop(grace=0.1)


def test_a_relay_beyond_loopback_of_a_guarded_upstream_needs_a_token_of_its_own(tmp_path):
    with pytest.raises(UsageError, match=r"need a token.*--read-token-file.*--open"):
        Relay("127.0.0.1:1", upstream_token="upstream-secret", host="0.0.0.0")
    Relay("127.0.0.1:1", upstream_token="upstream-secret", host="0.0.0.0", open=True).close()  # meant: allowed
    Relay("127.0.0.1:1", upstream_token="upstream-secret", read_token="readers-secret", host="0.0.0.0").close()


def test_a_relay_takes_its_readers_token_from_the_environment_too(monkeypatch):
    """``$PSSERVER_READ_TOKEN`` set for the upstream guards the relay's readers too: never open."""
    monkeypatch.setenv("PSSERVER_READ_TOKEN", "from-the-environment")
    relay = Relay("127.0.0.1:1", host="0.0.0.0")  # the upstream's token and its readers': the variable's
    try:
        assert relay._read_token == "from-the-environment"
    finally:
        relay.close()
