"""Several target replicas, a cache service (prefix index) and a router with a mesh config,
all real gRPC servers on loopback, for the routing tests."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from services.common.mesh_config import MeshConfig
from specmesh.proto.v1 import (
    cache_service_pb2,
    cache_service_pb2_grpc,
    router_service_pb2_grpc,
)
from services.common.server import GrpcServer, ServerConfig
from services.router.config import RouterConfig
from services.router.service import SERVICE_NAME, RouterService, add_to_server
from services.target.server.app import build_target_server
from services.target.config import EngineConfig
from services.target.engine.engine import Engine

ENGINE = EngineConfig(model_dir=Path("."), dtype="float32", num_blocks=256, block_size=4,
                      max_batched_tokens=128, max_tokens_limit=256, kernels="reference")


async def start_target(model_dir: Path, port: int = 0, **overrides) -> GrpcServer:
    engine = Engine.load(replace(ENGINE, model_dir=model_dir, **overrides))
    server = build_target_server(ServerConfig(port=port), engine, "tiny")
    await server.start()
    return server


async def start_cache(replicas: list[str]) -> GrpcServer:
    from services.cache.app import build_cache_server
    from services.cache.config import CacheConfig
    server = build_cache_server(CacheConfig(server=ServerConfig(port=0), replicas=tuple(replicas)))
    await server.start()
    return server


@dataclass
class Router:
    server: GrpcServer
    service: RouterService
    channel: grpc.aio.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.server.address)

    @property
    def stub(self) -> router_service_pb2_grpc.RouterServiceStub:
        return router_service_pb2_grpc.RouterServiceStub(self.channel)

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(grace=1.0)


async def start_router(mesh: MeshConfig, cache_address: str = "", **overrides) -> Router:
    config = RouterConfig(target_address="", mesh=mesh, cache_address=cache_address,
                          speculation_method="off", speculation_policy="fixed", max_tokens_limit=256,
                          **{"poll_interval_s": 60.0, **overrides})
    service = RouterService(config)
    server = GrpcServer(ServerConfig(port=0), lambda s: add_to_server(s, service), [SERVICE_NAME],
                        on_drain=service.drain, on_stopped=service.close)
    await server.start()
    return Router(server, service)


async def prefix_match(cache_address: str, hashes: list[int]) -> dict[str, int]:
    async with grpc.aio.insecure_channel(cache_address) as channel:
        stub = cache_service_pb2_grpc.CacheServiceStub(channel)
        response = await stub.PrefixMatch(cache_service_pb2.PrefixMatchRequest(block_hashes=hashes))
    return {m.replica: m.matched_blocks for m in response.matches}


async def generate(stub, req, metadata):
    """One Generate call -> (token ids, text, final chunk, route record)."""
    ids, text, last, route = [], "", None, None
    async for response in stub.Generate(req, metadata=metadata):
        ids.extend(response.chunk.token_ids)
        text += response.chunk.text
        last = response.chunk
        if response.HasField("route"):
            route = response.route
    return ids, text, last, route
