"""gRPC RouterService: the public entry point."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import uuid
from collections.abc import Callable

import grpc
from opentelemetry import trace

from specmesh.proto.v1 import (
    common_pb2,
    router_service_pb2,
    router_service_pb2_grpc,
    target_service_pb2,
)
from services.common.metrics import method_name
from services.common.metrics_interceptor import status_of
from services.common.metrics_router import RequestTimer
from services.common.errors import (
    Refusal,
    Violation,
    abort,
    abort_refusal,
    guard_malformed,
    relay_trailers,
)
from services.common.request_checks import CheckedRequest, check_request, routing_violations
from services.common.sampling_params import SamplingConfig
from services.common.telemetry import record_error
from services.common.tls import internal_channel
from services.router.auth import TenantAuth, Unauthenticated
from services.router.buckets import bucket_of
from services.router.cache_instances import CacheInstances
from services.router.config import RouterConfig
from services.router.models_list import list_models
from services.router.objective import NoPool
from services.router.quotas import QuotaExceeded, TenantQuotas
from services.router.retrieval import Retrieval, annotate, tenant_labels
from services.router.routing import Decision, RouteRequest, Routing, UpstreamError
from services.router.speculation_policy import PolicyConfig, SpeculationPolicy
from services.router.target_health import TargetHealthWatch
from services.router.tool_results import ToolResults

tracer = trace.get_tracer("specmesh.router")
SERVICE_NAME = router_service_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
# Reconnect to a restarted replica (or cache instance) within about a health-poll interval
# (gRPC's default backoff grows to two minutes).
REPLICA_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                           ("grpc.max_reconnect_backoff_ms", 2000)]
# Target errors the caller should see as they are; anything else becomes UNAVAILABLE.
# (A target-side CANCELLED is not the caller's doing: it becomes UNAVAILABLE.)
_PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}


class RouterService(router_service_pb2_grpc.RouterServiceServicer):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.auth = TenantAuth(config.tokens, config.salt_secret)

        def channel(address: str) -> grpc.aio.Channel:  # to a target replica or a cache instance
            return internal_channel(address, config.mesh_tls, REPLICA_CHANNEL_OPTIONS)

        # The cache service's instances (listed, or found by DNS): prefix index, retrieval and
        # tool results each send a call to the instance owning its key (services/router/cache_instances.py).
        self.cache = CacheInstances.from_address(config.cache_address, channel, config.poll_interval_s)
        self.routing = Routing(config.mesh, channel, self.cache, config.replica_policy, config.poll_interval_s,
                               config.model_cache)
        self.quotas = TenantQuotas(config.mesh.tenants)
        self.retrieval = Retrieval(self.cache, tenant_labels(config.mesh))
        self.tool_results = ToolResults(self.cache)
        self._routing_started: asyncio.Task | None = None
        # NOT_SERVING while no target replica is healthy (started with the server).
        self.health_watch = TargetHealthWatch(self.routing.any_healthy, config.poll_interval_s)
        self._in_flight = 0
        self._draining = False
        self.policy = SpeculationPolicy(PolicyConfig(mode=config.speculation_policy),
                                        default_depth=config.speculation_depth, methods=config.method_map)

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router is shutting down; retry")
        try:
            tenant = self.auth.tenant(context.invocation_metadata())
        except Unauthenticated as exc:
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, str(exc), "UNAUTHENTICATED")
        request_span = trace.get_current_span()  # the server span: ERROR status when the call fails
        with tracer.start_as_current_span("route") as span:
            checked = await self._check(request, context)
            sampling = checked.sampling
            rag = await self.retrieval.augment(request, tenant, context)  # may rewrite request.prompt
            bucket = bucket_of(request.prompt or "\n".join(m.content for m in request.messages), sampling,
                               structured=checked.constraint is not None)
            # The request's one id: every target attempt (retry, escalation) carries it.
            request_id = uuid.uuid4().hex
            span.set_attribute("specmesh.request_id", request_id)
            span.set_attribute("specmesh.bucket", bucket)
            span.set_attribute("gen_ai.request.max_tokens", sampling.max_tokens)

            @functools.cache
            def plan_for(pool: str) -> common_pb2.SpeculationPlan:  # once per pool tried
                return self._plan(bucket, sampling, pool)
            target_request = target_service_pb2.TargetServiceGenerateRequest(
                request_id=request_id, prompt=request.prompt, messages=request.messages, tools=request.tools,
                sampling=request.sampling,
                tenant_salt=self.auth.salt(tenant), bucket=bucket)
            route_request = RouteRequest(target_request, tenant, sampling.max_tokens, request.model, plan_for)
            release = await self._admit(route_request, context)
            try:
                decision = await self._decide(route_request, context)
                # The chosen pool's plan (an escalation plans its own pool's: RouteRequest.plan_for).
                target_request.speculation.CopyFrom(plan_for(decision.pool.name))
                await self._check_routing(target_request.speculation, bucket, context)
            except BaseException:
                release()
                raise
            span.set_attribute("specmesh.speculation", method_name(target_request.speculation.method))
        remaining = context.time_remaining()
        timeout = self.config.default_timeout_s if remaining is None else max(remaining, 0.001)
        self._in_flight += 1
        timer = RequestTimer(bucket, decision.pool.name, method_name(target_request.speculation.method))
        status, usage = None, None
        try:
            async for response in annotate(rag, self.routing.execute(decision, route_request, timeout)):
                timer.chunk(len(response.chunk.token_ids))
                if response.chunk.HasField("usage"):
                    usage = response.chunk.usage
                    if response.HasField("route"):  # the pool and method that ran (services/router/routing.py)
                        route = response.route
                        self.policy.observe(bucket, usage.proposed_tokens, usage.accepted_tokens,
                                            method_name(route.speculation.method), route.pool,
                                            usage.fallback_steps)
                yield response
            status = "OK"
        except UpstreamError as exc:
            code = exc.code if exc.code in _PASS_THROUGH else grpc.StatusCode.UNAVAILABLE
            status = code.name
            message = exc.details or code.name
            await context.abort(code, message, relay_trailers(exc.trailers, code, message))
        except BaseException as exc:  # the caller cancelled or its deadline passed
            status = status_of(context, exc)
            raise
        finally:
            self._in_flight -= 1
            release()
            timer.finish(status or "UNKNOWN", usage)
            if status != "OK":
                record_error(request_span, status or "UNKNOWN")

    async def _check(self, request, context) -> CheckedRequest:
        """The request contract (services/common/request_checks.py, the target runs the same);
        INVALID_ARGUMENT with field violations. Unknown `model` pools are the routing's to refuse."""
        try:
            return check_request(request, self.config.limits, self.config.max_tokens_limit, self.config.max_samples)
        except Refusal as refusal:
            await abort_refusal(context, refusal)

    async def _check_routing(self, plan, bucket: str, context) -> None:
        """The target's own checks of the fields the router decides (services/common/request_checks.py):
        a plan or bucket it would refuse is a router bug, INTERNAL here rather than at every target."""
        problems = routing_violations(plan, bucket, 0)
        if problems:
            await abort(context, grpc.StatusCode.INTERNAL, "router built a request the target refuses: "
                        + "; ".join(v.description for v in problems), "ROUTER_BUG")

    def _plan(self, bucket: str, sampling: SamplingConfig, pool: str) -> common_pb2.SpeculationPlan:
        """The speculation plan for a request on `pool`: method and depth from the policy
        (services/router/speculation_policy.py: the mapping's candidates for the pool and bucket,
        task, temperature, requested length, measured acceptance per method; load-aware plans
        let the target shorten it per step)."""
        chosen = self.policy.choose(bucket, sampling.max_tokens, sampling.temperature, pool)
        span = trace.get_current_span()
        span.set_attribute("specmesh.speculation.choice", chosen.choice)
        if chosen.depth == 0:
            return common_pb2.SpeculationPlan(method=common_pb2.SPECULATION_METHOD_OFF)
        return common_pb2.SpeculationPlan(
            method=common_pb2.SpeculationMethod.Value(f"SPECULATION_METHOD_{chosen.method.upper()}"),
            max_depth=chosen.depth, max_nodes=max(self.config.speculation_nodes, chosen.depth),
            load_aware=self.policy.load_aware, acceptance_prior=chosen.acceptance or 0.0)

    async def ListModels(self, request, context):
        try:
            self.auth.tenant(context.invocation_metadata())
        except Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        return list_models(self.routing.pools)

    async def IngestDocuments(self, request, context):  # services/router/retrieval.py
        return await self.retrieval.ingest(request, await self._tenant(context), context)

    async def RemoveDocuments(self, request, context):
        return await self.retrieval.remove(request, await self._tenant(context), context)

    async def LookupToolResult(self, request, context):  # services/router/tool_results.py
        return await self.tool_results.lookup(request, await self._tenant(context), context)

    async def StoreToolResult(self, request, context):
        return await self.tool_results.store(request, await self._tenant(context), context)

    async def _tenant(self, context) -> str:
        try:
            return self.auth.tenant(context.invocation_metadata())
        except Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

    async def drain(self) -> None:
        self._draining = True
        while self._in_flight:
            await asyncio.sleep(0.05)

    async def _admit(self, route_request: RouteRequest, context) -> Callable[[], None]:
        """Per-tenant quotas (services/router/quotas.py); over quota -> RESOURCE_EXHAUSTED + pushback."""
        samples = max(route_request.target.sampling.n, 1)  # each sample may generate max_tokens
        estimate = len(route_request.text.encode()) // 4 + route_request.max_tokens * samples
        try:
            return self.quotas.acquire(route_request.tenant, estimate)
        except QuotaExceeded as exc:  # RetryInfo and the grpc-retry-pushback-ms trailer
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "TENANT_QUOTA",
                        retry_after_s=exc.retry_after_ms / 1000)

    async def start(self) -> None:
        """One health/stats poll of every replica and the pools' tokenizers, then polls go on
        in the background (once; also on the first request if the server did not call it)."""
        if self._routing_started is None:  # in its own context: not part of a request's trace
            self._routing_started = asyncio.get_running_loop().create_task(
                self._start_routing(), context=contextvars.Context())
        await asyncio.shield(self._routing_started)

    async def _start_routing(self) -> None:
        await asyncio.gather(self.routing.start(), *([self.cache.start()] if self.cache is not None else []))

    async def _decide(self, route_request: RouteRequest, context) -> Decision:
        """Pool and replica plan (services/router/routing.py); an unknown `model` is INVALID_ARGUMENT."""
        await self.start()
        try:
            return await self.routing.decide(route_request)
        except NoPool as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), "NO_POOL",
                        [Violation("model", str(exc))] if route_request.model else ())

    async def close(self) -> None:
        await self.health_watch.close()
        await self.routing.close()
        if self.cache is not None:
            await self.cache.close()


def add_to_server(server: grpc.aio.Server, service: RouterService) -> None:
    # Requests that do not parse (invalid UTF-8, truncated bytes) get INVALID_ARGUMENT.
    router_service_pb2_grpc.add_RouterServiceServicer_to_server(service, guard_malformed(server))
