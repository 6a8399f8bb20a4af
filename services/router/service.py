"""gRPC RouterService: the public entry point."""

from __future__ import annotations

import asyncio
import uuid

import grpc
from opentelemetry import trace

from services.common.proto.specmesh.v1 import (
    common_pb2,
    router_service_pb2,
    router_service_pb2_grpc,
    target_service_pb2,
    target_service_pb2_grpc,
)
from services.common.sampling_params import SamplingConfig, sampling_from_proto
from services.common.tls import internal_channel
from services.router.auth import TenantAuth, Unauthenticated
from services.router.buckets import bucket_of
from services.router.config import RouterConfig
from services.router.models_list import list_models
from services.router.speculation_policy import PolicyConfig, SpeculationPolicy

tracer = trace.get_tracer("specmesh.router")
SERVICE_NAME = router_service_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
# Target errors the caller should see as they are; anything else becomes UNAVAILABLE.
# (A target-side CANCELLED is not the caller's doing: it becomes UNAVAILABLE.)
_PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}


class RouterService(router_service_pb2_grpc.RouterServiceServicer):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.auth = TenantAuth(config.tokens, config.salt_secret)
        self._channel = internal_channel(config.target_address, config.mesh_tls)
        self._target = target_service_pb2_grpc.TargetServiceStub(self._channel)
        self._in_flight = 0
        self._draining = False
        self.policy = SpeculationPolicy(PolicyConfig(mode=config.speculation_policy),
                                        default_depth=config.speculation_depth)

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router is shutting down; retry")
        try:
            tenant = self.auth.tenant(context.invocation_metadata())
        except Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        with tracer.start_as_current_span("route") as span:
            sampling = await self._validate(request, context)
            bucket = bucket_of(request.prompt or "\n".join(m.content for m in request.messages), sampling)
            span.set_attribute("specmesh.bucket", bucket)
            span.set_attribute("specmesh.route", "default")
            span.set_attribute("specmesh.speculation", self.config.speculation_method)
            span.set_attribute("gen_ai.request.max_tokens", sampling.max_tokens)
            target_request = target_service_pb2.TargetGenerateRequest(
                request_id=uuid.uuid4().hex, prompt=request.prompt, messages=request.messages,
                sampling=request.sampling,
                tenant_salt=self.auth.salt(tenant), bucket=bucket,
                speculation=self._plan(bucket))
        remaining = context.time_remaining()
        timeout = self.config.default_timeout_s if remaining is None else max(remaining, 0.001)
        self._in_flight += 1
        call = self._target.Generate(target_request, timeout=timeout)
        try:
            async for response in call:
                if response.chunk.HasField("usage"):
                    usage = response.chunk.usage
                    self.policy.observe(bucket, usage.proposed_tokens, usage.accepted_tokens)
                yield router_service_pb2.GenerateResponse(chunk=response.chunk)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            pushback = [(k, v) for k, v in (exc.trailing_metadata() or ())
                        if k == "grpc-retry-pushback-ms"]
            if pushback:
                context.set_trailing_metadata(tuple(pushback))
            if code in _PASS_THROUGH:
                await context.abort(code, exc.details() or code.name)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"target {self.config.target_address} unavailable: {exc.details()}")
        finally:
            self._in_flight -= 1
            call.cancel()  # no-op when finished; frees the target's blocks when we were cancelled

    async def _validate(self, request, context) -> SamplingConfig:
        problems = []
        if request.prompt and request.messages:
            problems.append("set prompt or messages, not both")
        elif request.messages:
            if not any(m.content.strip() for m in request.messages):
                problems.append("messages are empty")
        elif not request.prompt.strip():
            problems.append("prompt is empty")
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as exc:
            problems.append(str(exc))
            sampling = None
        if sampling is not None and sampling.max_tokens > self.config.max_tokens_limit:
            problems.append(f"max_tokens {sampling.max_tokens} is above the limit "
                            f"{self.config.max_tokens_limit}")
        if problems:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
        return sampling

    def _plan(self, bucket: str) -> common_pb2.SpeculationPlan:
        """The speculation plan for a bucket: the configured method, depth from the policy."""
        method = self.config.speculation_method
        depth = 0 if method == "off" else self.policy.depth(bucket)
        if depth == 0:
            return common_pb2.SpeculationPlan(method=common_pb2.SPECULATION_METHOD_OFF)
        return common_pb2.SpeculationPlan(
            method=common_pb2.SpeculationMethod.Value(f"SPECULATION_METHOD_{method.upper()}"),
            max_depth=depth, max_nodes=max(self.config.speculation_nodes, depth))

    async def ListModels(self, request, context):
        try:
            self.auth.tenant(context.invocation_metadata())
        except Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return list_models(self.routing.pools)

    async def drain(self) -> None:
        self._draining = True
        while self._in_flight:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self._channel.close()


def add_to_server(server: grpc.aio.Server, service: RouterService) -> None:
    router_service_pb2_grpc.add_RouterServiceServicer_to_server(service, server)
