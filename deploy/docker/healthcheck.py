#!/usr/bin/env python3
"""Container health check: asks the control plane's standard gRPC health service.

Exit 0 when the overall health ("" service) is SERVING, else 1 (Docker's contract). The
address is ``$PSSERVER_HEALTH_ADDRESS`` (default 127.0.0.1:50051, the default
``--control-port``); the health service needs no token. With ``--tls-cert`` on the server set
``PSSERVER_HEALTH_TLS_CA`` to a CA file (or the server's certificate) to check over TLS.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
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
        sys.stderr.write(f"psserver health: {address}: {e.code().name}\n")
        return 1
    finally:
        channel.close()
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        state = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        sys.stderr.write(f"psserver health: {address}: {state}\n")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
