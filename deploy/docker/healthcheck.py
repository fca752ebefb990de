#!/usr/bin/env python3
"""Container health check: asks the control plane's standard gRPC health service.

Exit 0 when the overall health ("" service) is SERVING, else 1 (Docker's contract): SERVING
means trainers can train now (with several server processes: every one has registered), the
question a readiness probe asks. ``--live`` asks whether the process is alive instead: any
answer passes, NOT_SERVING included (server 0 waiting for a lost server process is alive and
must not be restarted), no answer fails; for startup and liveness probes. The
address is ``$PSSERVER_HEALTH_ADDRESS`` (default 127.0.0.1:50051, the default
``--control-port``); the health service needs no token. With ``--tls-cert`` on the server set
``PSSERVER_HEALTH_TLS_CA`` to a CA file (or the server's certificate) to check over TLS.

Several server processes (``psserver serve --num-servers S``): only server 0 serves the
control plane. In a server of rank > 0 (``$PSSERVER_NUM_SERVERS`` above 1, and the rank from
``$PSSERVER_SERVER_RANK``, else ``$SLURM_PROCID``, else the ordinal of a host name such as
``psserver-2``: the defaults ``psserver serve`` uses) nothing listening on the address counts
as healthy; an answer other than SERVING still does not. One Kubernetes StatefulSet can so
probe every server with the same check.
"""

from __future__ import annotations

import os
import re
import socket
import sys


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return None


def server_rank() -> int:
    """This server's rank as ``psserver serve --server-rank`` defaults it."""
    for name in ("PSSERVER_SERVER_RANK", "SLURM_PROCID"):
        rank = _env_int(name)
        if rank is not None:
            return rank
    m = re.search(r"-(\d+)$", os.environ.get("HOSTNAME", "") or socket.gethostname())
    return int(m.group(1)) if m else 0


def serves_no_control_plane() -> bool:
    """A server of rank > 0 among several: the control plane is server 0's."""
    return (_env_int("PSSERVER_NUM_SERVERS") or 1) > 1 and server_rank() > 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a != "--live" for a in args):
        sys.stderr.write("usage: psserver-healthcheck [--live]\n")
        return 2
    live = "--live" in args
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = os.environ.get("PSSERVER_HEALTH_ADDRESS", "127.0.0.1:50051")
    ca = os.environ.get("PSSERVER_HEALTH_TLS_CA")
    if ca:
        with open(ca, "rb") as f:
            channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=f.read()))
    else:
        channel = grpc.insecure_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE and serves_no_control_plane():
            return 0  # nothing listens here: server 0 serves the control plane
        sys.stderr.write(f"psserver health: {address}: {e.code().name}\n")
        return 1
    finally:
        channel.close()
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    if live:
        return 0  # it answered: alive, whether or not the job can train now
    if not serving:
        state = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        sys.stderr.write(f"psserver health: {address}: {state}\n")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
