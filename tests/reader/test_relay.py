"""Relays of the weights over real gRPC: a chain (server -> relay A -> relay B) serves many
readers whole versions while the server sends each version to relay A only; row reads pass
through; the relay's read token guards it as the server's does."""

from __future__ import annotations

import threading

import pytest
import torch

from psserver.config.control import ControlConfig
from psserver.control.server import ControlServer
from psserver.errors import ServerUnavailable, UsageError
from psserver.reader.reader import Reader
from psserver.reader.relay import Relay


def follow(reader: Reader, versions: int, errors: list[str]) -> None:
    """Read ``versions`` newer versions, each whole (every value its step), steps increasing."""
    try:
        step = -1
        for _ in range(versions):
            version = reader.wait(step, timeout=30)
            assert version is not None, f"{reader.name}: no version past {step}"
            for key, t in version.state.items():
                assert torch.equal(t, torch.full_like(t, version.step)), f"{key} of step {version.step} is torn"
            assert version.step > step and version.age < 10
            step = version.step
    except Exception as e:  # noqa: BLE001 - reported by the test's thread
        errors.append(f"{reader.name}: {e}")


def test_a_chain_of_relays_feeds_eight_readers_while_the_server_sends_each_version_once(target, trained):
    trained.start()
    with ControlServer(target, ControlConfig(port=0), grace=0.5, weights=trained.versions).start() as server, \
            Relay(server.address, name="relay-a") as a, Relay(a.address, name="relay-b") as b:
        readers = [Reader(b.address, name=f"b{i}") for i in range(6)] + [Reader(a.address, name=f"a{i}")
                                                                           for i in range(2)]
        errors: list[str] = []
        threads = [threading.Thread(target=follow, args=(r, 15, errors)) for r in readers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for r in readers:
            r.close()
        assert not errors, errors
        # The server's only reader is relay A: each version it sent went to A, once (one more
        # may be on its way: sent whole, not yet in the relay's hands).
        seen = trained.versions.readers()
        assert [r.name for r in seen] == ["relay-a"] and a.fetched <= seen[0].reads <= a.fetched + 1
        assert b.fetched <= a.served and a.served >= 15 and b.served >= 6 * 15
        with Reader(b.address) as reader:  # rows are not cached: read through to the server
            assert torch.equal(reader.rows("users", [3, 1]).values, trained.table[[3, 1]])
            with pytest.raises(UsageError, match=r"INVALID_ARGUMENT: .*no embedding table 'items'"):
                reader.rows("items", [1])


def test_a_relays_read_token_guards_it_and_it_waits_out_an_upstream_not_there_yet(target, trained, tmp_path):
    token = tmp_path / "read.token"
    token.write_text("relay-readers\n")
    with Relay("127.0.0.1:1", read_token_file=token, timeout=2) as relay:  # nothing listens upstream
        with Reader(relay.address, timeout=2) as stranger, pytest.raises(UsageError, match="UNAUTHENTICATED"):
            stranger.latest()
        with Reader(relay.address, token_file=token, timeout=2) as reader, \
                pytest.raises(UsageError, match=r"FAILED_PRECONDITION: .*the relay has no version"):
            reader.latest()


def test_a_relay_serves_its_readers_tls_with_a_token_of_its_own(target, trained, tmp_path):
    """A relay of a guarded upstream, with its own readers' token over TLS: its readers need the
    certificate and its token; the upstream's token opens nothing on it."""
    from tests.control.test_security import make_certificate

    cert, key = make_certificate(tmp_path)
    trained.train_one()
    config = ControlConfig(port=0, read_token_file=_token(tmp_path / "upstream.token", "upstream-readers"))
    with ControlServer(target, config, grace=0.5, weights=trained.versions).start() as server, \
            Relay(server.address, upstream_token="upstream-readers", read_token="relay-readers", tls_cert=cert,
                  tls_key=key) as relay:
        with Reader(relay.address, token="relay-readers", tls_ca=cert, timeout=10) as reader:
            assert reader.latest().step == 1
        with Reader(relay.address, token="upstream-readers", tls_ca=cert, timeout=10) as other, \
                pytest.raises(UsageError, match="UNAUTHENTICATED"):
            other.latest()
        with Reader(relay.address, token="relay-readers", timeout=3) as plaintext, \
                pytest.raises(ServerUnavailable):
            plaintext.latest()


def _token(path, text):
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path
