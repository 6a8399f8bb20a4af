"""`python -m services.common.healthcheck HOST:PORT [SERVICE]`: exit 0 when SERVING (compose healthchecks)."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> str:
    """Returns the health status name of `service` at `address` (e.g. "SERVING")."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        status = check(argv[0], argv[1] if len(argv) > 1 else "")
    except grpc.RpcError as exc:
        print(f"{argv[0]}: {exc.code().name}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
