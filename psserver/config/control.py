"""Configuration of the gRPC control plane and of metrics export."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from psserver.config.common import check_host, check_input_file, check_output_dir, check_port, read_token_file
from psserver.config.options import option

TOKEN_ENV = "PSSERVER_AUTH_TOKEN"
READ_TOKEN_ENV = "PSSERVER_READ_TOKEN"
READ_DTYPES = ("", "float32", "bfloat16", "float16")
"""What a reader of the weights may ask floating-point tensors in (``""``: as the server holds them)."""


@dataclass
class ControlConfig:
    """The gRPC control plane served by ``psserver serve`` (and collective rank 0)."""

    host: str = option("127.0.0.1", flag="--control-host", help="control plane address (default {default})")
    """Address the control plane binds to."""
    port: int = option(50051, flag="--control-port", help="control plane port (default {default}; 0 picks one)")
    """Port of the control plane (0: pick a free one, logged at start)."""
    enabled: bool = option(True, flag="--no-control", negate=True, help="do not serve the control plane")
    """Serve the control plane at all."""
    auth_token_file: Path | None = option(
        None, help=f"bearer token required on every call but health (else ${TOKEN_ENV})")
    """File holding the bearer token; else ``$PSSERVER_AUTH_TOKEN``; else no token: reads are open,
    and Checkpoint and Shutdown take a local admin token that only this user on this host can read
    (``psserver.control.local_token``)."""
    tls_cert: Path | None = option(None, help="PEM certificate: serve TLS")
    """PEM certificate chain: serve TLS instead of plaintext."""
    tls_key: Path | None = option(None, help="PEM private key of --tls-cert")
    """PEM private key matching ``tls_cert``."""
    allow_unauthenticated_admin: bool = option(
        False, help="allow Checkpoint/Shutdown without a token when no token is configured")
    """Allow Checkpoint and Shutdown without a token when no token is configured (no local admin
    token is written then)."""
    reflection: bool = option(False, help="serve gRPC server reflection")
    """Serve gRPC server reflection."""
    read_token_file: Path | None = option(
        None, help=f"bearer token of readers of the weights (psserver pull, psserver.read), good for nothing else "
                   f"(else ${READ_TOKEN_ENV}; without it, reads take the control token, or are open without one)")
    """File holding the readers' token: it reads versions of the weights and nothing else (no
    push, join, checkpoint or stop); else ``$PSSERVER_READ_TOKEN``."""
    publish_interval: float = option(
        0.25, help="readers of the weights: at most one copy of the model per this many seconds, however many "
                  "read (default {default})")
    """The least time between two versions for readers: each is one copy of the model under the
    update lock, taken only when a reader asks for a newer one."""

    def __post_init__(self) -> None:
        if self.enabled:
            check_host(self.host, "--control-host")
        check_port(self.port, "--control-port", allow_zero=True)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        for flag, path in (("--auth-token-file", self.auth_token_file), ("--tls-cert", self.tls_cert),
                           ("--tls-key", self.tls_key), ("--read-token-file", self.read_token_file)):
            if path is not None:
                check_input_file(path, flag)
        if not (math.isfinite(self.publish_interval) and 0 <= self.publish_interval <= 3600):
            raise ValueError(f"--publish-interval must be between 0 and 3600 seconds, got {self.publish_interval}")
        token = self.token()  # an empty or unreadable token file: a usage error at start
        read = self.read_token()
        if read is not None and read == token:
            raise ValueError("the read token is the control token: give readers a token of their own "
                             "(--read-token-file), which opens nothing but the weights")

    def token(self) -> str | None:
        """The configured bearer token: read when the config is built (an empty or unreadable
        file is a usage error there) and again by the control server at its start, so the
        config itself never holds the secret (a dataclass's repr shows its fields)."""
        if self.auth_token_file is not None:
            return read_token_file(self.auth_token_file, "--auth-token-file")
        return os.environ.get(TOKEN_ENV) or None

    def read_token(self) -> str | None:
        """The readers' token (read as :meth:`token`)."""
        if self.read_token_file is not None:
            return read_token_file(self.read_token_file, "--read-token-file")
        return os.environ.get(READ_TOKEN_ENV) or None


@dataclass
class ObservabilityConfig:
    """Prometheus metrics and TensorBoard event files."""

    metrics_port: int | None = option(None, help="serve Prometheus metrics on this port")
    """Serve Prometheus metrics on this port (None: off)."""
    metrics_host: str = option("127.0.0.1", help="address of the metrics endpoint (default {default})")
    """Address of the metrics endpoint."""
    tensorboard_dir: Path | None = option(None, help="write TensorBoard event files here")
    """Write loss, accuracy and throughput with torch's SummaryWriter here."""

    def __post_init__(self) -> None:
        if self.metrics_port is not None:
            check_host(self.metrics_host, "--metrics-host")
            check_port(self.metrics_port, "--metrics-port", allow_zero=True)
        check_output_dir(self.tensorboard_dir, "--tensorboard-dir")
