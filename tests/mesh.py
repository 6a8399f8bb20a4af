"""Starts real target + router gRPC servers on loopback for tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from specmesh.proto.v1 import (
    common_pb2,
    router_service_pb2,
    router_service_pb2_grpc,
    target_service_pb2_grpc,
)
from services.common.server import GrpcServer, ServerConfig
from specmesh.client import AsyncClient
from services.common.tls import MeshTls
from services.router.app import build_router_server
from services.router.config import RouterConfig
from services.target.server.app import build_target_server
from services.target.config import EngineConfig
from services.target.engine.engine import Engine

TOKEN_A, TOKEN_B = "token-a", "token-b"
AUTH_A = (("authorization", f"Bearer {TOKEN_A}"),)
AUTH_B = (("authorization", f"Bearer {TOKEN_B}"),)


@dataclass
class Mesh:
    engine: Engine
    target: GrpcServer
    router: GrpcServer
    channel: grpc.aio.Channel
    router_tls: MeshTls | None = None  # the router's mesh identity when the mesh runs mutual TLS

    @property
    def router_stub(self) -> router_service_pb2_grpc.RouterServiceStub:
        return router_service_pb2_grpc.RouterServiceStub(self.channel)

    def target_stub(self) -> target_service_pb2_grpc.TargetServiceStub:
        """A direct stub to the target; under mutual TLS it presents the router's certificate."""
        if self.router_tls is None:
            return target_service_pb2_grpc.TargetServiceStub(grpc.aio.insecure_channel(self.target.address))
        return target_service_pb2_grpc.TargetServiceStub(
            grpc.aio.secure_channel(self.target.address, self.router_tls.channel_credentials()))

    async def stop(self) -> None:
        await self.channel.close()
        await self.router.stop(grace=1.0)
        await self.target.stop(grace=1.0)


async def start_mesh(model_dir: Path, speculation: dict | None = None, tls_dir: Path | None = None,
                     **engine_overrides) -> Mesh:
    """Target + router. `speculation` sets the router's plan (RouterConfig speculation_* fields);
    by default the router asks for none, so tests without a draft service stay plain.
    With `tls_dir` (from `make_dev_certs`) router -> target -> draft calls use mutual TLS;
    the router's public port stays plaintext."""
    target_tls = MeshTls.from_dir(tls_dir, "target") if tls_dir else None
    config = EngineConfig(model_dir=model_dir, dtype="float32", num_blocks=256, block_size=4,
                          max_batched_tokens=64, max_tokens_limit=256, kernels="cpu",
                          mesh_tls=target_tls)
    engine = Engine.load(replace(config, **engine_overrides))
    target = build_target_server(ServerConfig(port=0, tls=target_tls and target_tls.server_tls()),
                                 engine, "tiny")
    await target.start()
    if engine.speculator is not None:  # so that the first decode steps already speculate
        for _ in range(250):
            if engine.speculator.client.connected:
                break
            await asyncio.sleep(0.02)
    # The fixed policy: a test asks for exactly the plan it checks.
    plan = {"speculation_method": "off", "speculation_policy": "fixed", **(speculation or {})}
    router_tls = MeshTls.from_dir(tls_dir, "router") if tls_dir else None
    router = build_router_server(ServerConfig(port=0), RouterConfig(
        target_address=target.address, tokens={TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"},
        max_tokens_limit=256, mesh_tls=router_tls, **plan))
    await router.start()
    return Mesh(engine, target, router, grpc.aio.insecure_channel(router.address), router_tls)


def request(prompt: str, max_tokens: int = 16, **sampling) -> router_service_pb2.GenerateRequest:
    return router_service_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling))


async def collect(stub, req, metadata=AUTH_A) -> tuple[list[int], str, common_pb2.GenerateChunk]:
    """Runs one Generate call through a stub or a specmesh.client.AsyncClient (benchmarks);
    returns (token ids, text, final chunk)."""
    ids, text, last = [], "", None
    calls = stub.stream if isinstance(stub, AsyncClient) else stub.Generate
    async for response in calls(req, metadata=metadata):
        ids.extend(response.chunk.token_ids)
        text += response.chunk.text
        last = response.chunk
    return ids, text, last


async def start_draft(draft_model_dir: Path | None = None, tls_dir: Path | None = None,
                      **overrides) -> GrpcServer:
    """A draft server; with `tls_dir` it serves mutual TLS (the target's certificate calls it)."""
    from services.draft.app import build_draft_server
    from services.draft.config import DraftConfig
    tls = MeshTls.from_dir(tls_dir, "draft").server_tls() if tls_dir else None
    config = DraftConfig(server=ServerConfig(port=0, tls=tls), draft_model_dir=draft_model_dir,
                         draft_model_dtype="float32", **overrides)
    server = build_draft_server(config)
    await server.start()
    return server


async def first_sample(stub, make_request, wanted, tries: int = 64, batch: int = 16) -> tuple[int, list[int]]:
    """(seed, token ids) of the first seed in range(tries) whose sample satisfies `wanted(ids)`
    (`make_request(seed)` builds the request; `batch` run at a time): a real sample that does
    something rare (a control token mid-stream, an end-of-sequence token), found by search
    instead of forced."""
    for first in range(0, tries, batch):
        seeds = range(first, min(first + batch, tries))
        results = await asyncio.gather(*(collect(stub, make_request(seed)) for seed in seeds))
        for seed, (ids, _, _) in zip(seeds, results):
            if wanted(ids):
                return seed, ids
    raise AssertionError(f"no sample of the seeds in range({tries}) {wanted.__name__}")
