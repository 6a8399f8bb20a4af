"""Where each request goes: pool (λ objective), replica (prefix index vs load), retry,
confidence escalation — and the route record that says so.

`Routing.decide` (inside the router's `route` span) tokenizes the prompt per pool, looks
up cached prefixes, and chooses the pool; `Routing.execute` runs the request on a replica
of that pool and streams `GenerateResponse`s whose last one carries the `RouteRecord`.
- A replica failing before the first token is ejected and the request retried once on
  another replica of the pool.
- A pool configured to escalate for the request's bucket answers first *held*: nothing
  is streamed until its final usage; when its confidence is below the pool's threshold
  the answer is discarded and the request runs on `escalate_to` (an *upgrade*).
- A pool with `escalate_to` that fails with UNAVAILABLE / RESOURCE_EXHAUSTED before its
  first token hands the request to `escalate_to` (a *fallback*).
Errors leave as `UpstreamError` (code, details, trailers) for the service to abort with.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from opentelemetry import trace

from services.common.mesh_config import MeshConfig
from services.common.metrics import method_name
from specmesh.proto.v1 import (
    common_pb2,
    router_service_pb2,
    target_service_pb2,
)
from services.router import route_metrics
from services.router.cache_instances import CacheInstances
from services.router.escalation import below_threshold
from services.router.objective import PoolChoice, PoolView, choose_pool
from services.router.pools import Pool, PrefixLookup, build_pools
from services.router.replicas import Replica

tracer = trace.get_tracer("specmesh.router")
# Target errors the caller sees as they are; anything else becomes UNAVAILABLE.
PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}
# Failures before the first token that another replica may not share.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
ESCALATE_ON = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


class UpstreamError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple = (),
                 streamed: bool = False) -> None:
        super().__init__(details)
        self.code, self.details, self.trailers, self.streamed = code, details, trailers, streamed


@dataclass
class RouteRequest:
    target: target_service_pb2.TargetServiceGenerateRequest  # what every replica gets (priority set per call)
    tenant: str
    max_tokens: int
    model: str = ""  # an explicit pool name, or ""
    # The speculation plan for a pool (the router's policy chooses the method per pool and
    # bucket); None = `target.speculation` on every pool.
    plan_for: Callable[[str], common_pb2.SpeculationPlan] | None = None

    @property
    def text(self) -> str:
        """The prompt text risk rules read (chat messages joined)."""
        return self.target.prompt or "\n".join(m.content for m in self.target.messages)

    @property
    def bucket(self) -> str:
        return self.target.bucket


@dataclass
class Decision:
    choice: PoolChoice
    pool: Pool
    escalate: bool  # hold this pool's answer and check its confidence
    prompt_ids: dict[str, list[int] | None] = field(default_factory=dict)  # per pool
    cached: dict[str, dict[str, int]] = field(default_factory=dict)  # pool -> address -> tokens
    block_hashes: dict[str, list[int]] = field(default_factory=dict)  # pool -> the prompt's (kv_aware)


@dataclass
class _Attempt:
    """What one pool produced: the streamed (or held) responses and where they came from."""

    replica: str = ""
    retried: bool = False
    predicted_cached: int = 0
    held: list = field(default_factory=list)
    final: common_pb2.GenerateChunk | None = None
    request_id: str = ""  # the id the replica knew this attempt by
    plan: common_pb2.SpeculationPlan | None = None  # the speculation plan this attempt ran


class Routing:
    def __init__(self, mesh: MeshConfig, channel_factory: Callable[[str], grpc.aio.Channel],
                 cache: CacheInstances | None, policy: str, poll_interval_s: float,
                 model_cache: Path | str) -> None:  # the router's settings (services/router/settings.py)
        self.mesh = mesh
        self.policy = policy
        self.pools = build_pools(mesh.pools, channel_factory, policy, poll_interval_s,
                                 Path(model_cache).expanduser())
        self.prefix = PrefixLookup(cache)  # the cache instances are the service's

    async def start(self) -> None:
        """First health/stats poll of every replica; tokenizers load meanwhile (off the loop)."""
        await asyncio.gather(*(p.replicas.start() for p in self.pools.values()),
                             *(p.tokenize("warm up") for p in self.pools.values()))

    async def close(self) -> None:
        await asyncio.gather(*(p.replicas.close() for p in self.pools.values()))

    def any_healthy(self) -> bool:
        return any(p.replicas.healthy() for p in self.pools.values())

    # ---- decide ----------------------------------------------------------------
    async def decide(self, req: RouteRequest) -> Decision:
        """Chooses the pool; raises objective.NoPool for an unknown or too-short `model`."""
        decision_views, prompt_ids, cached, block_hashes = [], {}, {}, {}
        tokenized: dict[str, asyncio.Future] = {}  # pools of one model tokenize once
        views = await asyncio.gather(*(self._view(pool, req, tokenized) for pool in self.pools.values()))
        for pool, (view, ids, per_replica, hashes) in zip(self.pools.values(), views):
            decision_views.append(view)
            prompt_ids[pool.name], cached[pool.name], block_hashes[pool.name] = ids, per_replica, hashes
        tenant = self.mesh.tenant(req.tenant)
        choice = choose_pool(decision_views, prompt=req.text, max_tokens=req.max_tokens, bucket=req.bucket,
                             weights=self.mesh.weights_for(req.tenant), rules=self.mesh.risk_rules,
                             tenant_flags=tenant.risk_flags if tenant else (), model=req.model)
        pool = self.pools[choice.pool.name]
        span = trace.get_current_span()
        span.set_attribute("specmesh.route", pool.name)
        span.set_attribute("specmesh.pool", pool.name)
        span.set_attribute("specmesh.route.reason", choice.reason)
        for term in ("cost", "latency_s", "quality", "risk", "total"):
            span.set_attribute(f"specmesh.route.{term}", getattr(choice.score, term))
        return Decision(choice, pool, pool.config.escalates(req.bucket), prompt_ids, cached, block_hashes)

    async def _view(self, pool: Pool, req: RouteRequest, tokenized: dict[str, asyncio.Future]
                    ) -> tuple[PoolView, list[int] | None, dict[str, int], list[int]]:
        if pool.config.model not in tokenized:
            tokenized[pool.config.model] = asyncio.ensure_future(
                pool.tokenize(req.target.prompt, req.target.messages))
        ids = await tokenized[pool.config.model]
        prompt_tokens = len(ids) if ids is not None else pool.estimate_tokens(req.text)
        per_replica: dict[str, int] = {}
        hashes: list[int] = []
        if self.policy == "kv_aware" and ids is not None:
            hashes = pool.block_hashes(ids[:-1], req.target.tenant_salt)  # the last token is always computed
            per_replica = await self.prefix.cached_tokens(hashes, pool.replicas.healthy(),
                                                          pool.replicas.block_size() or 0)
        best = pool.replicas.choose(prompt_tokens, per_replica, peek=True)
        view = PoolView(pool.config, prompt_tokens,
                        cached_tokens=per_replica.get(best.address, 0) if best else 0,
                        queued_tokens=best.load_tokens if best else 0, tpot_s=pool.tpot_s,
                        available=best is not None)
        return view, ids, per_replica, hashes

    # ---- execute ---------------------------------------------------------------
    async def execute(self, decision: Decision, req: RouteRequest, timeout: float
                      ) -> AsyncIterator[router_service_pb2.GenerateResponse]:
        deadline = time.monotonic() + timeout
        pool, escalated_from = decision.pool, ""
        cfg = pool.config
        if cfg.escalate_to:
            route_metrics.add(route_metrics.CANDIDATES, {"specmesh.bucket": req.bucket, "specmesh.pool": pool.name})
        attempt = _Attempt()
        try:
            if decision.escalate:
                await self._drain(self._run_pool(pool, decision, req, deadline, attempt, hold=True))
                if not below_threshold(cfg, attempt.final.usage):
                    for response in attempt.held:
                        yield response
                    yield self._final(decision, req, attempt, escalated_from)
                    return
                route_metrics.add(route_metrics.UPGRADES, {"specmesh.bucket": req.bucket,
                                                           "specmesh.pool": pool.name, "specmesh.to": cfg.escalate_to})
            else:
                async for response in self._run_pool(pool, decision, req, deadline, attempt, hold=False):
                    yield response
                yield self._final(decision, req, attempt, escalated_from)
                return
        except UpstreamError as exc:
            if exc.streamed or exc.code not in ESCALATE_ON or not cfg.escalate_to:
                raise
            route_metrics.add(route_metrics.FALLBACKS, {"specmesh.bucket": req.bucket,
                                                        "specmesh.pool": pool.name, "specmesh.to": cfg.escalate_to})
        # Escalate: the cheap answer (or failure) is discarded; the client sees only this one.
        escalated_from, pool = pool.name, self.pools[cfg.escalate_to]
        with tracer.start_as_current_span("route.escalate") as span:
            span.set_attribute("specmesh.route.escalated_from", escalated_from)
            span.set_attribute("specmesh.pool", pool.name)
            span.set_attribute("specmesh.bucket", req.bucket)
        attempt = _Attempt()
        async for response in self._run_pool(pool, decision, req, deadline, attempt, hold=False):
            yield response
        yield self._final(decision, req, attempt, escalated_from, pool)

    async def _run_pool(self, pool: Pool, decision: Decision, req: RouteRequest, deadline: float,
                        attempt: _Attempt, hold: bool) -> AsyncIterator[router_service_pb2.GenerateResponse]:
        """Streams (or holds) one pool's answer; one retry on another replica before the first token."""
        ids = decision.prompt_ids.get(pool.name)
        prompt_tokens = len(ids) if ids is not None else pool.estimate_tokens(req.text)
        cached = decision.cached.get(pool.name, {})
        tried: set[str] = set()
        failure: UpstreamError | None = None
        for try_number in range(2):
            replica = pool.replicas.choose(prompt_tokens, cached, exclude=tried)
            if replica is None:
                if failure is not None:
                    raise failure  # no other replica to retry on: the caller sees the real error
                raise UpstreamError(grpc.StatusCode.UNAVAILABLE,
                                    f"no healthy replica in pool {pool.name!r}")
            if failure is not None:
                route_metrics.add(route_metrics.RETRIES, {"specmesh.pool": pool.name})
            tried.add(replica.address)
            attempt.replica, attempt.retried = replica.address, try_number > 0
            attempt.held.clear()  # a held answer that failed midway is dropped whole
            attempt.final = None
            attempt.predicted_cached = cached.get(replica.address, 0)
            try:
                async for response in self._call(pool, replica, req, deadline, prompt_tokens, attempt, hold,
                                                 decision.block_hashes.get(pool.name, [])):
                    yield response
                if attempt.final is None:
                    raise UpstreamError(grpc.StatusCode.UNAVAILABLE, f"replica {replica.address} ended the "
                                        "stream without a final message", streamed=not hold)
                return
            except UpstreamError as exc:
                if exc.streamed or exc.code not in RETRYABLE or try_number == 1:
                    raise
                if exc.code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    pool.replicas.mark_failed(replica)
                failure = exc

    async def _call(self, pool: Pool, replica: Replica, req: RouteRequest, deadline: float,
                    prompt_tokens: int, attempt: _Attempt, hold: bool, block_hashes: list[int]):
        tenant = self.mesh.tenant(req.tenant)
        target_request = target_service_pb2.TargetServiceGenerateRequest()
        target_request.CopyFrom(req.target)  # with the request's one id: a retry goes to another replica
        # (or pool), where it is not in flight; a replica would refuse it as DUPLICATE_REQUEST_ID
        attempt.request_id = target_request.request_id
        if req.plan_for is not None:
            target_request.speculation.CopyFrom(req.plan_for(pool.name))
        attempt.plan = target_request.speculation
        target_request.priority = tenant.priority if tenant else 0
        target_request.report_confidence = hold
        # Load this request puts on the replica: its uncached prompt until the first token
        # (prefill done), then only its decode tokens. Counting the whole prompt until the end
        # made a replica decoding a few tokens look as busy as a full prefill, so kv_aware sent
        # a tenant's next request away from the replica holding its prefix.
        prefill = max(0, prompt_tokens - attempt.predicted_cached)
        replica.in_flight += 1
        replica.in_flight_tokens += prefill + req.max_tokens
        sent = object()  # this call's prompt blocks count as held there while it runs
        replica.sent[sent] = block_hashes
        call = replica.stub.Generate(target_request, timeout=max(deadline - time.monotonic(), 0.001))
        streamed, first_at = False, None
        try:
            async for response in call:
                chunk = response.chunk
                if first_at is None:
                    first_at = time.monotonic()
                    replica.in_flight_tokens -= prefill
                    prefill = 0
                if chunk.HasField("usage"):
                    attempt.final = chunk
                    _observe_tpot(pool, first_at,  # n samples decode side by side: per sample
                                  chunk.usage.completion_tokens // max(req.target.sampling.n, 1))
                    if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        continue  # goes out with the route record (_final); the stream ends here
                out = router_service_pb2.GenerateResponse(chunk=chunk)
                if hold:
                    attempt.held.append(out)
                else:
                    streamed = True
                    yield out
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            trailers = tuple((k, v) for k, v in (exc.trailing_metadata() or ())
                             if k in ("grpc-retry-pushback-ms", "grpc-status-details-bin"))
            if code not in PASS_THROUGH and code not in RETRYABLE:
                code = grpc.StatusCode.UNAVAILABLE
            raise UpstreamError(code, f"replica {replica.address} of pool {pool.name}: {exc.details()}",
                                trailers, streamed) from None
        finally:
            replica.in_flight -= 1
            replica.in_flight_tokens -= prefill + req.max_tokens
            del replica.sent[sent]
            if attempt.final is not None:
                pool.replicas.refresh(replica)  # its queue and cache changed
            call.cancel()  # no-op when finished; frees the target's blocks when we were cancelled

    @staticmethod
    async def _drain(iterator) -> None:
        async for _ in iterator:
            pass

    def _final(self, decision: Decision, req: RouteRequest, attempt: _Attempt, escalated_from: str,
               pool: Pool | None = None) -> router_service_pb2.GenerateResponse:
        """The final message: the held/last chunk (text, finish reason, usage) plus the route record."""
        pool = pool or decision.pool
        score = decision.choice.score
        route = router_service_pb2.RouteRecord(
            bucket=req.bucket, pool=pool.name, replica=attempt.replica,
            speculation=attempt.plan if attempt.plan is not None else req.target.speculation,
            escalated=bool(escalated_from), escalated_from=escalated_from,
            reason=decision.choice.reason,
            score=router_service_pb2.RouteScore(cost=score.cost, latency_s=score.latency_s,
                                                quality=score.quality, risk=score.risk, total=score.total),
            predicted_cached_tokens=attempt.predicted_cached, retried=attempt.retried,
            request_id=attempt.request_id)
        route_metrics.add(route_metrics.ROUTES, {"specmesh.bucket": req.bucket, "specmesh.pool": pool.name,
                                                 "specmesh.replica": attempt.replica, "specmesh.route.reason": route.reason,
                                                 "specmesh.speculation.method": method_name(route.speculation.method)})
        return router_service_pb2.GenerateResponse(chunk=attempt.final, route=route)


def _observe_tpot(pool: Pool, first_at: float | None, completion_tokens: int) -> None:
    if first_at is not None and completion_tokens > 1:
        pool.observe_tpot((time.monotonic() - first_at) / (completion_tokens - 1))
