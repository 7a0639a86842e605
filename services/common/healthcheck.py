"""python -m services.common.healthcheck HOST:PORT: exit 0 when the gRPC server there says SERVING
(grpc.health.v1), 1 otherwise. For container health checks."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def serving(address: str, timeout_s: float = 3.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m services.common.healthcheck HOST:PORT")
    sys.exit(0 if serving(sys.argv[1]) else 1)
