"""Bearer tokens, admin calls without a token, and TLS, through a real gRPC server."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
from pathlib import Path

import grpc
import pytest

from psserver.control import SERVICE_NAME
from psserver.control.client import ControlClient, ControlError, ControlUnavailable
from psserver.control.v1 import control_pb2 as pb
from psserver.control.v1 import control_pb2_grpc as pb_grpc

from .fakes import TOKEN, serve

pytestmark = pytest.mark.timeout(60)


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(ControlError) as e:
        fn()
    return e.value.code


# ---- tokens ------------------------------------------------------------------------------------


def test_refusals_are_counted_and_their_log_is_rate_limited(auth_server, caplog):
    """A flood of bad-token calls (a scanner, a client with a stale token) writes a few lines,
    not one per call; every refusal is counted for ``psserver_control_refusals_total``."""
    from psserver.control.auth import CallLogInterceptor
    from psserver.telemetry import CONTROL_REFUSALS, RefusalLog

    before = CONTROL_REFUSALS.counts().get("UNAUTHENTICATED", 0)
    with caplog.at_level("WARNING", logger="psserver.control.auth"), \
            ControlClient(auth_server.address, token="wrong-token") as wrong:
        for _ in range(200):
            assert _code(wrong.get_status) == grpc.StatusCode.UNAUTHENTICATED
    lines = [r for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert len(lines) <= CONTROL_REFUSALS.burst, len(lines)  # (earlier tests may have used the window)
    assert CONTROL_REFUSALS.counts()["UNAUTHENTICATED"] - before == 200
    # The summary line of what was left out comes with the next line a new window logs.
    log = RefusalLog(burst=2, interval=0.0)
    assert [log.refused("X") for _ in range(2)] == [(True, 0), (True, 0)]
    log.interval = 3600.0
    assert log.refused("X") == (True, 0)  # the second line of this window
    assert log.refused("X") == (False, 0) and log.refused("X") == (False, 0)
    log.interval = 0.0
    assert log.refused("X") == (True, 2) and log.counts() == {"X": 6}
    assert CallLogInterceptor()._refusals is CONTROL_REFUSALS


def test_every_call_but_health_needs_the_token(auth_server, target):
    with ControlClient(auth_server.address) as anonymous:
        assert _code(anonymous.get_status) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(anonymous.list_trainers) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: next(anonymous.watch(0.5))) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(anonymous.checkpoint) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(anonymous.shutdown) == grpc.StatusCode.UNAUTHENTICATED
        assert anonymous.health() == "SERVING"  # probes need no credentials
    assert not target.shutdown_requested.is_set() and not target.checkpoints
    with ControlClient(auth_server.address, token="wrong-token") as wrong:
        assert _code(wrong.get_status) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(wrong.shutdown) == grpc.StatusCode.UNAUTHENTICATED
    assert not target.shutdown_requested.is_set()
    with ControlClient(auth_server.address, token=TOKEN) as good:  # the server kept serving
        assert good.get_status().state == pb.SERVER_STATE_SERVING
        assert len(good.list_trainers()) == 2
        assert good.checkpoint().path == target.checkpoints[-1].path
        good.shutdown()
    assert target.shutdown_requested.is_set()


@pytest.mark.parametrize(
    "metadata",
    [
        (("authorization", "Basic czNjcmV0LXRva2Vu"),),
        (("authorization", "Bearer"),),
        (("authorization", TOKEN),),  # the token without its scheme
        (("authorization", f"Bearer {TOKEN}x"),),
        (("x-token", TOKEN),),
    ],
)
def test_malformed_or_wrong_credentials_are_unauthenticated(auth_server, metadata):
    with grpc.insecure_channel(auth_server.address) as channel:
        stub = pb_grpc.ControlServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.GetStatus(pb.GetStatusRequest(), metadata=metadata, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub.GetStatus(pb.GetStatusRequest(), metadata=(("authorization", f"bearer {TOKEN}"),), timeout=5)
        assert ok.state == pb.SERVER_STATE_SERVING  # scheme is case-insensitive


def test_token_from_the_environment(target, monkeypatch):
    monkeypatch.setenv("PSSERVER_AUTH_TOKEN", "env-token")
    with serve(target) as control:
        with ControlClient(control.address) as anonymous:
            assert _code(anonymous.get_status) == grpc.StatusCode.UNAUTHENTICATED
        with ControlClient(control.address, token="env-token") as good:
            assert good.get_status().model == "mlp"


def test_admin_calls_are_refused_without_a_configured_token(server, target):
    with ControlClient(server.address) as client:
        assert client.get_status().state == pb.SERVER_STATE_SERVING  # reads are open
        assert _code(client.checkpoint) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(client.shutdown) == grpc.StatusCode.PERMISSION_DENIED
    with ControlClient(server.address, token="anything") as client:  # not the server's local admin token
        assert _code(client.shutdown) == grpc.StatusCode.UNAUTHENTICATED
    assert not target.shutdown_requested.is_set() and not target.checkpoints


def test_allow_unauthenticated_admin(target):
    with serve(target, allow_unauthenticated_admin=True) as control, ControlClient(control.address) as client:
        assert client.checkpoint().step >= 0
        client.shutdown()
    assert target.shutdown_requested.is_set()


def test_reflection_is_off_by_default_and_needs_the_token_when_on(target, token_file):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def list_services(address: str, metadata=()) -> list[str]:
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            responses = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata, timeout=5
            )
            return [s.name for r in responses for s in r.list_services_response.service]

    with serve(target) as plain:
        with pytest.raises(grpc.RpcError) as e:
            list_services(plain.address)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with serve(target, reflection=True, auth_token_file=token_file) as control:
        with pytest.raises(grpc.RpcError) as e:
            list_services(control.address)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        names = list_services(control.address, (("authorization", f"Bearer {TOKEN}"),))
        assert SERVICE_NAME in names and "grpc.health.v1.Health" in names


def test_a_second_server_on_the_same_port_fails_to_bind(server, target):
    from psserver.config.control import ControlConfig
    from psserver.control.server import ControlServer
    from psserver.errors import UsageError

    with pytest.raises(UsageError, match="cannot listen"):
        ControlServer(target, ControlConfig(port=server.port)).start()


# ---- TLS --------------------------------------------------------------------------------------


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1/localhost: (cert.pem, key.pem)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        try:
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                 "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                check=True, capture_output=True, timeout=30,
            )
        except (OSError, subprocess.SubprocessError) as e:
            pytest.skip(f"neither the cryptography package nor a working openssl to make a test certificate: {e}")
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert, key


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    return make_certificate(tmp_path)


def test_tls_round_trip_with_a_token(target, tls_files, token_file):
    cert, key = tls_files
    with serve(target, tls_cert=cert, tls_key=key, auth_token_file=token_file) as control:
        assert control.tls
        with ControlClient(control.address, token=TOKEN, tls_ca=cert) as client:
            assert client.get_status().model == "mlp"
            assert client.health() == "SERVING"
            assert client.checkpoint().path.endswith(".pt")
        with ControlClient(control.address, token="wrong", tls_ca=cert) as wrong:
            assert _code(wrong.get_status) == grpc.StatusCode.UNAUTHENTICATED
        with ControlClient(control.address, token=TOKEN) as plaintext:  # no TLS against a TLS server
            with pytest.raises(ControlUnavailable):
                plaintext.get_status(timeout=3)
        with ControlClient(control.address, token=TOKEN, tls_ca=cert) as client:  # still serving
            assert client.get_status().state == pb.SERVER_STATE_SERVING


def test_tls_client_rejects_an_unknown_certificate(target, tls_files, tmp_path):
    cert, key = tls_files
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other_cert, _ = make_certificate(other_dir)
    with serve(target, tls_cert=cert, tls_key=key) as control:
        with ControlClient(control.address, tls_ca=other_cert) as client:
            with pytest.raises(ControlUnavailable):
                client.get_status(timeout=3)


def test_a_garbage_certificate_is_one_clear_line(target, tmp_path):
    from psserver.errors import UsageError

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("garbage\n")
    with pytest.raises(UsageError, match=r"are not a PEM certificate and its private key \(PEM lib\)$"):
        serve(target, tls_cert=garbage, tls_key=garbage)


# ---- tokens gRPC metadata cannot carry ---------------------------------------------------------

UNUSABLE_TOKENS = [("tök", "it holds a non-ASCII character"), ("a\nb", r"it holds a control character ('\n')"),
                   ("a\0b", r"it holds a control character ('\x00')"), ("x" * 100_000, "it is 100000 characters long")]
UNUSABLE_IDS = ["non-ascii", "newline", "nul", "too-long"]
WHY = "; a token is printable ASCII, at most 4096 characters"


@pytest.mark.parametrize(("token", "why"), UNUSABLE_TOKENS, ids=UNUSABLE_IDS)
def test_a_server_does_not_start_with_a_token_no_client_can_send(target, tmp_path, monkeypatch, token, why):
    """It started, and every call then failed inside gRPC (Invalid metadata, RESOURCE_EXHAUSTED)."""
    from psserver.errors import UsageError

    path = tmp_path / "token"
    path.write_text(token)
    with pytest.raises(UsageError) as e:
        serve(target, auth_token_file=path)
    assert str(e.value) == f"--auth-token-file {path}: unusable bearer token: {why}{WHY}"
    if "\0" not in token:  # no environment variable holds a NUL
        monkeypatch.setenv("PSSERVER_AUTH_TOKEN", token)
        with pytest.raises(UsageError) as e:
            serve(target)
        assert str(e.value) == f"$PSSERVER_AUTH_TOKEN: unusable bearer token: {why}{WHY}"

