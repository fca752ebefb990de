"""The checks every verb's config shares: addresses, devices, seeds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from psserver.config import ServerConfig, TrainerConfig
from psserver.config.common import (
    DataConfig,
    check_device,
    check_output_file,
    check_seed,
    parse_bytes,
    parse_host_port,
    read_join_token,
)
from psserver.config.control import ControlConfig, ObservabilityConfig
from tests.procs import cli


def test_addresses_split_into_host_and_port():
    assert parse_host_port("127.0.0.1:5") == ("127.0.0.1", 5)
    assert parse_host_port("[::1]:29500") == ("::1", 29500)
    assert parse_host_port("node-3", 29500) == ("node-3", 29500)
    for host in ("localhost", "0.0.0.0", "ps-0.ps.default.svc.cluster.local.", "compose_server", "255.255.255.255"):
        assert parse_host_port(f"{host}:1") == (host, 1)


@pytest.mark.parametrize(("value", "says"), [
    ("::1", "an IPv6 address goes in brackets, as [ADDRESS]:PORT"),  # not host ':' port 1
    ("fe80::1:29500", "in brackets"),
    ("h:x", "port 'x' is not a number"),
    (":5", "has no host"),
    ("[]:5", "has no host"),
    ("a" * 5000 + ":5", "has no host (a host name has 1 to 253 characters)"),
    ("h:70000", "out of range"),
    ("host", "must be HOST:PORT"),
    # Refused here, not retried for the whole --connect-timeout.
    ("999.9.9.9:29500", "'999.9.9.9' is not an IPv4 address (four numbers 0 to 255, as 10.0.0.1)"),
    ("10.0.0:29500", "'10.0.0' is not an IPv4 address"),
    ("[fe80::zz]:29500", "'fe80::zz' is not an IPv6 address"),
    ("my host:29500", "'my host' is not a host name or address"),
    ("a..b:29500", "'a..b' is not a host name or address"),
])
def test_bad_addresses_are_one_line(value, says):
    with pytest.raises(ValueError) as info:
        parse_host_port(value)
    assert says in str(info.value) and "\n" not in str(info.value) and len(str(info.value)) < 200


def test_devices_and_seeds():
    for good in ("cpu", "cuda", "cuda:0", "cuda:12"):
        check_device(good, "--device")
    for bad in ("cudaX", "cuda:", "cuda:abc", "gpu", "cpu:0", ""):
        with pytest.raises(ValueError, match="use cpu or cuda:N"):
            check_device(bad, "--device")
    check_seed(0, "--seed")
    check_seed(2**63 - 1, "--seed")
    for bad in (-1, 2**63):
        with pytest.raises(ValueError, match=r"--seed must be in 0..2\^63-1"):
            check_seed(bad, "--seed")


def test_a_launchers_ipv6_master_addr_is_bracketed(monkeypatch):
    """torchrun takes MASTER_ADDR=::1 as it is; as a default --server it needs brackets."""
    from psserver.config.env import default_server_address

    monkeypatch.setenv("MASTER_ADDR", "::1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    assert parse_host_port(default_server_address()) == ("::1", 29555)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    assert parse_host_port(default_server_address()) == ("10.0.0.5", 29555)


@pytest.mark.parametrize("flag", ["--join-token-file", "--auth-token-file", "--tls-cert"])
@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_a_file_to_read_that_is_a_fifo_or_a_directory_is_not_a_regular_file(tmp_path, flag, kind):
    """Not "file not found", and a FIFO never opened (the open would wait for a writer forever)."""
    path = tmp_path / kind
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    build = {"--join-token-file": lambda: TrainerConfig(join_token_file=path),
             "--auth-token-file": lambda: ControlConfig(auth_token_file=path),
             "--tls-cert": lambda: ControlConfig(tls_cert=path, tls_key=path)}[flag]
    with pytest.raises(ValueError) as info:
        build()
    assert str(info.value) == f"{flag} {path} is not a regular file"
    with pytest.raises(ValueError, match=f"--join-token-file {path} is not a regular file"):
        read_join_token(path)  # where a trainer and the server read it
    with pytest.raises(ValueError, match="--join-token-file: file not found: "):
        TrainerConfig(join_token_file=tmp_path / "missing")


@pytest.mark.parametrize(("flag", "build"), [
    ("--host", lambda host: ServerConfig(host=host, no_join_token=True)),
    ("--control-host", lambda host: ControlConfig(host=host)),
    ("--metrics-host", lambda host: ObservabilityConfig(metrics_port=9100, metrics_host=host)),
])
def test_addresses_to_bind_are_hosts(flag, build):
    build("::")
    build("0.0.0.0")
    with pytest.raises(ValueError, match=f"{flag} '300.1.1.1' is not an IPv4 address"):
        build("300.1.1.1")


def test_an_output_file_that_is_a_fifo_or_a_device_is_refused_at_start(tmp_path):
    # the write at the end of the run would block on a FIFO until someone reads it: forever
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"--stats-out .*fifo is not a regular file"):
        check_output_file(fifo, "--stats-out")
    with pytest.raises(ValueError, match="is not a regular file"):
        check_output_file("/dev/zero", "--stats-out")
    check_output_file(os.devnull, "--stats-out")  # nothing kept, as asked
    check_output_file(tmp_path / "new.json", "--stats-out")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "localhost", "::1", "[::1]"])
def test_a_loopback_server_needs_no_join_token(host, monkeypatch):
    monkeypatch.delenv("PSSERVER_JOIN_TOKEN", raising=False)
    assert ServerConfig(host=host).host == host


def test_a_server_beyond_loopback_needs_a_join_token_or_says_it_does_without(monkeypatch, tmp_path):
    monkeypatch.delenv("PSSERVER_JOIN_TOKEN", raising=False)
    with pytest.raises(ValueError, match=r"--host 10.1.2.3 is reachable beyond this machine: .*--no-join-token"):
        ServerConfig(host="10.1.2.3")
    assert ServerConfig(host="10.1.2.3", no_join_token=True).no_join_token
    token = tmp_path / "token"
    token.write_text("secret\n")
    assert ServerConfig(host="server", join_token_file=token).host == "server"
    monkeypatch.setenv("PSSERVER_JOIN_TOKEN", "secret")
    assert ServerConfig(host="10.1.2.3").host == "10.1.2.3"


@pytest.mark.parametrize(("text", "size"), [("4096", 4096), ("512M", 512 << 20), ("1g", 1 << 30), ("2GiB", 2 << 30),
                                            ("1.5K", 1536)])
def test_sizes_in_bytes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "-1", "0", "1X", "1e9", "99999999999T"])
def test_sizes_that_are_not(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


def test_serve_beyond_loopback_without_a_token_is_one_line_before_anything_starts():
    r = cli(["serve", "--host", "10.1.2.3", "--no-control", "--max-model-bytes", "2G"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "--host 10.1.2.3 is reachable beyond this machine" in r.stderr, r.stderr
    r = cli(["serve", "--max-model-bytes", "lots"])
    assert r.returncode == 2 and "'lots' is not a size in bytes" in r.stderr, r.stderr


def test_the_data_directory_never_defaults_to_a_path_of_the_install(monkeypatch):
    monkeypatch.delenv("PSSERVER_DATA_DIR", raising=False)
    assert DataConfig().data_dir == Path("data")
    monkeypatch.setenv("PSSERVER_DATA_DIR", "/srv/mnist")
    assert DataConfig().data_dir == Path("/srv/mnist")
    assert "default $PSSERVER_DATA_DIR, else ./data" in " ".join(cli(["train", "--help"]).stdout.split())


def test_the_read_token_must_not_be_the_join_token(tmp_path):
    """A reader's credential that could join the RPC group as a trainer would not be read-only."""
    token = tmp_path / "token"
    token.write_text("one-token-for-all")
    with pytest.raises(ValueError, match="the read token is the join token"):
        ServerConfig(join_token_file=token, control=ControlConfig(read_token_file=token))
