"""specmesh: LLM serving as a mesh of gRPC services. `specmesh.client` is the light client
library (grpcio + protobuf only); the services live in the `services` package."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("specmesh")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
