"""``psserver status|checkpoint|stop`` in-process against a real control server."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest

from psserver.cli import main
from psserver.telemetry import ReaderStatus

from .fakes import TOKEN, serve, two_servers, two_tables
from .test_security import UNUSABLE_IDS, UNUSABLE_TOKENS, WHY, make_certificate

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _restore_logging():
    """main() points the root logger at the (captured) stderr: undo it after each test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["--log-level", "ERROR", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_status_table(server, capsys):
    rc, out, err = run(capsys, "status", "--address", server.address)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"psserver 0.1.0 at {server.address}  SERVING  (mode ps, up 2m")
    assert "model       mlp, 1,234 parameters" in out
    assert "updates     sync (one step per 2 gradients)" in out
    assert "checkpoint  none" in out
    shard_head = next(i for i, line in enumerate(lines) if line.startswith("SHARD"))
    # The shard's own bytes, with its optimizer's state ("-": not known), never the process's memory.
    assert lines[shard_head].split() == ["SHARD", "DEVICE", "PARAMS", "SIZE", "WITH", "OPTIMIZER"]
    assert lines[shard_head + 1].split() == ["0", "cpu", "1,000", "3.9", "KiB", "11.7", "KiB"]
    assert lines[shard_head + 2].split() == ["1", "cpu", "234", "936", "B", "-"]
    assert "TRAINERS    1 active, 0 left, 1 lost" in out
    rows = [line.split() for line in lines if line.lstrip().startswith(("0  trainer", "1  trainer"))]
    assert rows[0][:8] == ["0", "trainer_0_0", "hostA", "pushpull", "staged", "ACTIVE", "10", "640"]
    assert rows[1][:6] == ["1", "trainer_1_0", "hostB", "-", "-", "LOST"] and rows[1][8] == "-"
    head = next(line for line in lines if line.startswith("RANK"))
    assert "SAMPLES/S  CLOCK  STALENESS  MAX STALENESS  NON-FINITE  JOINED" in head
    assert head.split()[:6] == ["RANK", "NAME", "HOST", "STEP", "TRANSPORT", "STATE"]
    assert rows[0][10:13] == ["11", "2", "5"]  # clock, staleness, max staleness
    assert rows[1][10:13] == ["-", "-", "-"]  # no step on the server: nothing to show
    assert rows[0][13] == "0" and rows[1][13] == "3"  # non-finite gradients dropped
    # Which path the live trainers' buffers take, and why: a slow fallback is never silent.
    assert "transport   staged for rank 0: the server is on another host, so through pinned host memory" in lines
    assert ("trainer_1_0 (rank 1) evicted: sent 3 non-finite gradients in a row (--max-nonfinite-steps 3)"
            in lines)
    assert "SERVERS" not in out  # one server process: nothing to list


def test_status_table_of_readers(server, target, capsys):
    target.readers = [ReaderStatus("rollout-0", "ipv4:127.0.0.1:41000", 1234, time.time() - 2, 0.25, 17)]
    rc, out, _ = run(capsys, "status", "--address", server.address)
    assert rc == 0
    header = next(line for line in out.splitlines() if line.startswith("READER"))
    row = out.splitlines()[out.splitlines().index(header) + 1].split()
    assert header.split() == ["READER", "PEER", "STEP", "AGE", "READS", "HOST", "LAST", "READ"]
    assert row[:7] == ["rollout-0", "ipv4:127.0.0.1:41000", "1,234", "250", "ms", "17", "1"]
    rc, out, _ = run(capsys, "status", "--address", server.address, "--json")
    assert rc == 0 and json.loads(out)["status"]["readers"][0]["name"] == "rollout-0"


def test_status_table_of_several_server_processes(server, target, capsys):
    target.servers = two_servers()
    rc, out, err = run(capsys, "status", "--address", server.address)
    assert rc == 0, err
    lines = out.splitlines()
    at = lines.index("SERVERS     1 serving, 1 lost, 0 missing")
    head = lines[at + 1]
    assert head.split() == ["SERVER", "NAME", "HOST", "STATE", "PARAMS", "SIZE", "SHARE", "UPDATES", "LAST", "SEEN"]
    rows = [line.split() for line in lines[at + 2:at + 4]]
    # rank, name, host, state, parameters, size (2 words), share of the bytes, updates, last seen (2 words)
    assert rows[0] == ["0", "ps_0", "hostA", "SERVING", "3,000", "11.7", "KiB", "75.0%", "40", "0.0s", "ago"]
    assert rows[1] == ["1", "ps_1", "hostB", "LOST", "1,000", "3.9", "KiB", "25.0%", "38", "1m", "15s", "ago"]
    # Numbers right-aligned under their heading, text left-aligned.
    assert lines[at + 2].index("75.0%") + len("75.0%") == head.index("SHARE") + len("SHARE")
    assert lines[at + 3].index("LOST") == head.index("STATE")
    # Between the shards and the trainers.
    assert lines.index(next(x for x in lines if x.startswith("SHARD"))) < at < lines.index(
        next(x for x in lines if x.startswith("TRAINERS")))

    rc, out, err = run(capsys, "status", "--address", server.address, "--json")
    assert rc == 0, err
    servers = json.loads(out)["status"]["servers"]
    assert [(s["rank"], s["state"], s["bytes"], s["last_seen_age_seconds"]) for s in servers] == [
        (0, "SERVING", 12000, 0.0), (1, "LOST", 4000, 75.0)]


def test_one_listed_server_process_is_no_table(server, target, capsys):
    target.servers = two_servers()[:1]
    rc, out, err = run(capsys, "status", "--address", server.address)
    assert rc == 0 and "SERVERS" not in out and "ps_0" not in out, err


def test_status_table_of_embedding_tables(server, target, capsys):
    target.servers, target.tables = two_servers(), two_tables()
    rc, out, err = run(capsys, "status", "--address", server.address)
    assert rc == 0, err
    lines = out.splitlines()
    at = lines.index("TABLES      2 tables on 2 servers, 3,540 rows, 7.0 MiB")
    head = lines[at + 1]
    assert head.split() == ["TABLE", "SERVER", "ROWS", "MAX", "BYTES", "ADMITTED", "REFUSED", "EVICTED", "EXPIRED",
                            "LOOKUPS/S", "UPDATES/S"]
    rows = [line.split() for line in lines[at + 2:at + 5]]
    # table, server, rows, max, bytes (2 words), admitted, refused, evicted, expired, lookups/s, updates/s
    assert rows[0] == ["users", "0", "1,500", "2,000", "3.0", "MiB", "1,600", "250", "0", "100", "1,234.5", "1,200.5"]
    assert rows[1] == ["items", "0", "40", "2,000", "4.0", "KiB", "40", "7", "0", "0", "0.0", "0.0"]
    assert rows[2] == ["users", "1", "2,000", "2,000", "4.0", "MiB", "2,600", "300", "600", "0", "1,300.0", "1,250.0"]
    # Numbers right-aligned under their heading, text left-aligned.
    assert lines[at + 3].index("40") + 2 == head.index("ROWS") + len("ROWS")
    assert lines[at + 2].index("1,200.5") + len("1,200.5") == len(head)
    assert lines[at + 3].startswith("items ")
    # After the server processes, before the trainers.
    assert lines.index(next(x for x in lines if x.startswith("SERVERS"))) < at < lines.index(
        next(x for x in lines if x.startswith("TRAINERS")))

    rc, out, err = run(capsys, "status", "--address", server.address, "--json")
    assert rc == 0, err
    tables = json.loads(out)["status"]["tables"]
    assert [(t["table"], t["server_rank"], t["rows"], t["evictions"], t["lookups_per_second"]) for t in tables] == [
        ("users", 0, 1500, 0, 1234.5), ("items", 0, 40, 0, 0.0), ("users", 1, 2000, 600, 1300.0)]


def test_status_table_of_one_server_with_a_table(server, target, capsys):
    target.tables = two_tables()[1:2]
    rc, out, err = run(capsys, "status", "--address", server.address)
    assert rc == 0, err
    assert "TABLES      1 table on 1 server, 40 rows, 4.0 KiB" in out.splitlines()
    assert "SERVERS" not in out


def test_status_table_of_an_ssp_server(server, target, capsys):
    target.update_mode, target.sync_trainers, target.staleness = "ssp", 0, 3
    rc, out, err = run(capsys, "status", "--address", server.address)
    assert rc == 0, err
    assert "updates     ssp (no trainer more than 3 steps ahead of the slowest)" in out
    target.staleness = 0
    rc, out, err = run(capsys, "status", "--address", server.address, "--json")
    assert rc == 0, err
    st = json.loads(out)["status"]
    assert st["update_mode"] == "ssp" and st["staleness"] == 0
    rc, out, err = run(capsys, "status", "--address", server.address)
    assert "updates     ssp (bulk-synchronous: staleness 0)" in out


def test_status_shows_the_learning_rate(server, target, capsys):
    rc, out, _ = run(capsys, "status", "--address", server.address)
    assert rc == 0 and "\nlr " not in out  # the optimizer is not known yet
    st = json.loads(run(capsys, "status", "--address", server.address, "--json")[1])["status"]
    assert st["learning_rate"] is None and st["lr_schedule"] == ""
    target.learning_rate = 0.1
    assert "lr          0.1 (constant)" in run(capsys, "status", "--address", server.address)[1]
    target.learning_rate, target.lr_schedule = 0.0975528258147577, "CosineAnnealingLR(T_max=200)"
    assert "lr          0.0975528 (CosineAnnealingLR(T_max=200))" in run(capsys, "status", "--address",
                                                                       server.address)[1]
    st = json.loads(run(capsys, "status", "--address", server.address, "--json")[1])["status"]
    assert st["learning_rate"] == 0.0975528258147577 and st["lr_schedule"] == "CosineAnnealingLR(T_max=200)"


def test_status_json(server, target, capsys):
    target.checkpoint_now()
    rc, out, err = run(capsys, "status", "--address", server.address, "--json")
    assert rc == 0, err
    data = json.loads(out)
    st = data["status"]
    assert st["state"] == "SERVING" and st["mode"] == "ps" and st["update_mode"] == "sync"
    assert st["model"] == "mlp" and st["num_params"] == 1234 and st["sync_trainers"] == 2
    assert st["global_step"] >= 0 and isinstance(st["samples_per_second"], float)
    shards = [(s["device"], s["bytes"], s["state_bytes"]) for s in st["shards"]]
    assert shards == [("cpu", 4000, 12016), ("cpu", 936, 0)]
    assert st["last_checkpoint"]["path"] == target.checkpoints[-1].path
    assert [(t["rank"], t["state"]) for t in data["trainers"]] == [(0, "ACTIVE"), (1, "LOST")]
    assert [(t["nonfinite"], t["reason"][:20]) for t in data["trainers"]] == [(0, ""), (3, "sent 3 non-finite gr")]
    assert data["trainers"][1]["last_loss"] is None  # JSON null, not NaN
    assert st["staleness"] == 0  # S of ssp; this fake runs sync
    assert st["servers"] == []  # one server process
    assert st["tables"] == [] and "TABLES" not in run(capsys, "status", "--address", server.address)[1]  # dense
    first = data["trainers"][0]
    assert (first["clock"], first["staleness"], first["max_staleness"], first["step"]) == (11, 2, 5, "pushpull")


def test_status_address_from_the_environment(server, capsys, monkeypatch):
    monkeypatch.setenv("PSSERVER_CONTROL_ADDRESS", server.address)
    rc, out, _ = run(capsys, "status", "--json")
    assert rc == 0 and json.loads(out)["status"]["model"] == "mlp"


def test_status_watch_json_lines_until_the_server_stops(server, target, capsys):
    threading.Timer(0.5, setattr, (target, "state", "STOPPED")).start()
    rc, out, err = run(capsys, "status", "--address", server.address, "--watch", "--json", "--interval", "0.1")
    assert rc == 0, err
    updates = [json.loads(line) for line in out.splitlines()]
    assert len(updates) >= 3
    assert updates[-1]["status"]["state"] == "STOPPED"
    steps = [u["status"]["global_step"] for u in updates]
    assert steps == sorted(steps)
    assert "ended the stream" in err


def test_status_watch_table(server, target, capsys):
    threading.Timer(1.0, setattr, (target, "state", "STOPPED")).start()  # >= 3 refreshes even on a busy host
    rc, out, _ = run(capsys, "status", "--address", server.address, "--watch", "--interval", "0.1")
    assert rc == 0
    assert out.count("SHARD  DEVICE") >= 3 and "STOPPED" in out


def test_status_watch_rejects_a_bad_interval(server, capsys):
    rc, _, err = run(capsys, "status", "--address", server.address, "--watch", "--interval", "0")
    assert rc == 2 and _error_lines(err) == ["psserver status: error: --interval must be between 0.1 and 3600 seconds"]


def test_unreachable_server_is_one_line_and_exit_2(capsys, port):
    rc, out, err = run(capsys, "status", "--address", f"127.0.0.1:{port}", "--timeout", "3")
    assert rc == 2 and out == ""
    lines = _error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("psserver status: error: control plane at 127.0.0.1:")
    assert "unreachable" in lines[0]


@pytest.mark.parametrize(("address", "says"), [
    ("nonsense", "must be HOST:PORT"), ("", "must be HOST:PORT"), ("127.0.0.1:65536", "out of range 1..65535"),
    ("::1", "in brackets"),
])
def test_bad_address_is_a_usage_error(capsys, address, says):
    rc, _, err = run(capsys, "status", "--address", address)
    assert rc == 2 and len(_error_lines(err)) == 1 and "--address: " in err and says in err, err


def test_wrong_token_is_one_line_and_exit_2(auth_server, capsys, monkeypatch, tmp_path):
    rc, _, err = run(capsys, "status", "--address", auth_server.address)
    assert rc == 2 and _error_lines(err) == [
        "psserver status: error: GetStatus failed: UNAUTHENTICATED: missing bearer token: send metadata "
        "'authorization: Bearer <token>' (psserver: --auth-token-file or $PSSERVER_AUTH_TOKEN)"
    ]
    monkeypatch.setenv("PSSERVER_AUTH_TOKEN", "wrong")
    rc, _, err = run(capsys, "status", "--address", auth_server.address)
    assert rc == 2
    assert _error_lines(err) == ["psserver status: error: GetStatus failed: UNAUTHENTICATED: invalid bearer token"]
    monkeypatch.setenv("PSSERVER_AUTH_TOKEN", TOKEN)
    rc, out, err = run(capsys, "status", "--address", auth_server.address, "--json")
    assert rc == 0 and json.loads(out)["status"]["state"] == "SERVING"


def test_token_file_wins_over_the_environment(auth_server, token_file, capsys, monkeypatch):
    monkeypatch.setenv("PSSERVER_AUTH_TOKEN", "wrong")
    rc, _out, err = run(capsys, "status", "--address", auth_server.address, "--auth-token-file", str(token_file))
    assert rc == 0, err


@pytest.mark.parametrize(("content", "says"), [
    (None, "nope: cannot read it (No such file or directory)"), (b"", "nope is empty"),
    (b"\xff\xfe", "nope: cannot read it ('utf-8' codec can't decode"),
], ids=["missing", "empty", "not-text"])
def test_a_token_file_that_holds_no_token(server, capsys, tmp_path, content, says):
    path = tmp_path / "nope"
    if content is not None:
        path.write_bytes(content)
    rc, _, err = run(capsys, "status", "--address", server.address, "--auth-token-file", str(path))
    assert rc == 2 and len(_error_lines(err)) == 1 and f"--auth-token-file {tmp_path}/{says}" in err, err


@pytest.mark.parametrize("flag", ["--auth-token-file", "--tls-ca"])
def test_a_fifo_is_not_read(capsys, tmp_path, port, flag):
    """Refused unopened: status waited forever in the open of a FIFO for a writer."""
    os.mkfifo(tmp_path / "fifo")
    rc, _, err = run(capsys, "status", "--address", f"127.0.0.1:{port}", flag, str(tmp_path / "fifo"))
    assert rc == 2 and _error_lines(err) == [f"psserver status: error: {flag} {tmp_path}/fifo is not a regular file"]


def test_status_over_tls(target, tmp_path, capsys):
    cert, key = make_certificate(tmp_path)
    with serve(target, tls_cert=cert, tls_key=key) as control:
        rc, out, err = run(capsys, "status", "--address", control.address, "--tls-ca", str(cert), "--json")
        assert rc == 0, err
        assert json.loads(out)["status"]["model"] == "mlp"
        rc, _, err = run(capsys, "status", "--address", control.address, "--timeout", "3")  # plaintext to TLS
        assert rc == 2 and _error_lines(err) == [
            f"psserver status: error: {control.address} is not a psserver control plane (it closes connections "
            "without a gRPC answer; is it the RPC port, or a control plane with TLS (--tls-ca)?)"], err


def test_checkpoint_verb(target, token_file, capsys):
    with serve(target, auth_token_file=token_file) as control:
        args = ("--address", control.address, "--auth-token-file", str(token_file))
        rc, out, err = run(capsys, "checkpoint", *args)
        assert rc == 0, err
        assert out.startswith(f"checkpoint written: {target.checkpoints[-1].path} (step ")
        rc, out, _ = run(capsys, "checkpoint", *args, "--json")
        assert rc == 0 and json.loads(out)["path"] == target.checkpoints[-1].path
        rc, _, err = run(capsys, "checkpoint", "--address", control.address)
        assert rc == 2 and "UNAUTHENTICATED" in err and len(_error_lines(err)) == 1


def test_checkpoint_verb_without_checkpoint_dir(target, capsys):
    target.checkpoint_dir = None
    with serve(target, allow_unauthenticated_admin=True) as control:
        rc, _, err = run(capsys, "checkpoint", "--address", control.address)
    assert rc == 2
    assert _error_lines(err) == [
        "psserver checkpoint: error: Checkpoint failed: FAILED_PRECONDITION: cannot checkpoint: "
        "checkpoints are not configured (--checkpoint-dir)"
    ]


def test_stop_verb(target, token_file, capsys):
    with serve(target, auth_token_file=token_file) as control:
        rc, _, err = run(capsys, "stop", "--address", control.address)
        assert rc == 2 and "UNAUTHENTICATED" in err and not target.shutdown_requested.is_set()
        rc, out, err = run(capsys, "stop", "--address", control.address, "--auth-token-file", str(token_file))
        assert rc == 0, err
        assert out.strip() == f"server at {control.address} is draining"
        assert target.shutdown_requested.is_set()


def test_stop_wait_returns_once_the_server_is_gone(target, capsys):
    control = serve(target, allow_unauthenticated_admin=True)

    def stop_when_asked():
        target.shutdown_requested.wait(10)
        control.stop()

    stopper = threading.Thread(target=stop_when_asked)
    stopper.start()
    try:
        rc, out, err = run(capsys, "stop", "--address", control.address, "--wait", "--reason", "test")
    finally:
        stopper.join(10)
        control.stop()
    assert rc == 0, err
    assert out.splitlines() == [f"server at {control.address} is draining", f"server at {control.address} has stopped"]


@pytest.mark.parametrize("verb", ["status", "checkpoint"])
@pytest.mark.parametrize("timeout", ["1e20", "1e-300", "0", "86401"])
def test_a_timeout_grpc_cannot_use_is_one_line(server, capsys, verb, timeout):
    """1e20 overflowed gRPC's deadline: 'unreachable (DEADLINE_EXCEEDED)' of a live server."""
    rc, _, err = run(capsys, verb, "--address", server.address, "--timeout", timeout)
    assert rc == 2
    assert _error_lines(err) == [f"psserver {verb}: error: --timeout must be between 0.01 and 86400 seconds "
                                 f"(one day), got {float(timeout):g}"]


def test_the_longest_timeout_reaches_a_live_server(server, capsys):
    rc, out, err = run(capsys, "status", "--address", server.address, "--timeout", "86400")
    assert rc == 0, err
    assert "SERVING" in out


@pytest.mark.parametrize(("token", "why"), UNUSABLE_TOKENS, ids=UNUSABLE_IDS)
def test_a_client_refuses_a_token_it_cannot_send(server, tmp_path, monkeypatch, capsys, token, why):
    """gRPC's own lines (validate_metadata.cc, 'Invalid metadata') or RESOURCE_EXHAUSTED before."""
    path = tmp_path / "token"
    path.write_text(token)
    assert main(["--log-level", "ERROR", "status", "--address", server.address, "--auth-token-file", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"psserver status: error: --auth-token-file {path}: unusable bearer token: {why}{WHY}"]
    if "\0" not in token:
        monkeypatch.setenv("PSSERVER_AUTH_TOKEN", token)
        assert main(["--log-level", "ERROR", "checkpoint", "--address", server.address]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"psserver checkpoint: error: $PSSERVER_AUTH_TOKEN: unusable bearer token: {why}{WHY}"]


@pytest.mark.parametrize("behaviour", ["silent", "closes"])
def test_a_port_that_does_not_speak_grpc_is_named_so(capsys, behaviour):
    """A psserver RPC port (it accepts, then waits for its own protocol) was 'unreachable
    (DEADLINE_EXCEEDED)', as if nothing listened there."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            if behaviour == "closes":
                conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        rc, _, err = run(capsys, "status", "--address", address, "--timeout", "1")
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
    assert rc == 2
    why = {"silent": "it accepts connections but does not speak gRPC; is it the RPC port?",
           "closes": "it closes connections without a gRPC answer; is it the RPC port, or a control plane with TLS "
                     "(--tls-ca)?"}[behaviour]
    assert _error_lines(err) == [f"psserver status: error: {address} is not a psserver control plane ({why})"]


def test_a_closed_port_is_still_unreachable(capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    rc, _, err = run(capsys, "status", "--address", f"127.0.0.1:{port}", "--timeout", "1")
    assert rc == 2 and _error_lines(err)[0].startswith(f"psserver status: error: control plane at 127.0.0.1:{port} "
                                                       "unreachable (")
