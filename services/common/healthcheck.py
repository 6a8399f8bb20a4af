"""`python -m services.common.healthcheck HOST:PORT [SERVICE] [--tls-as IDENTITY]`: exit 0 when
SERVING (compose healthchecks). With `--tls-as`, the check presents that service's mesh
certificate (from SPECMESH_TLS_DIR / SPECMESH_TLS_*), as internal services require."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tls import MeshTls, internal_sync_channel


def check(address: str, service: str = "", timeout: float = 3.0, tls: MeshTls | None = None) -> str:
    """Returns the health status name of `service` at `address` (e.g. "SERVING");
    over mutual TLS with `tls`, plaintext without."""
    with internal_sync_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str]) -> int:
    tls = None
    if "--tls-as" in argv:
        at = argv.index("--tls-as")
        if at + 1 >= len(argv):
            print(__doc__, file=sys.stderr)
            return 2
        from services.common.env import read_settings
        from services.common.tls import load_mesh_tls
        tls = load_mesh_tls(read_settings(others_ok=True), argv[at + 1])  # the mesh-wide settings
        argv = argv[:at] + argv[at + 2:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        status = check(argv[0], argv[1] if len(argv) > 1 else "", tls=tls)
    except grpc.RpcError as exc:
        print(f"{argv[0]}: {exc.code().name}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
