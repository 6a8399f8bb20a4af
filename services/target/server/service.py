"""gRPC TargetService: streams a request through the engine."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc
from opentelemetry import trace

from specmesh.proto.v1 import (
    common_pb2,
    target_service_pb2,
    target_service_pb2_grpc,
)
from services.common.errors import Violation, abort, guard_malformed
from services.common.metrics_interceptor import status_of
from services.common.request_checks import BucketLabels, checked_plan, routing_violations
from services.common.sampling_params import params_violations, sampling_from_proto
from services.common.telemetry import record_error
from services.target.server.chat import ChatTemplateError, chat_prompt_ids, tool_texts
from services.target.server.logprob_chunks import TokenTexts, logprobs_proto
from services.target.structured.request import compile_constraint
from services.target.engine.engine import Engine, InvalidRequest, Overloaded
from services.target.engine.engine_types import DuplicateRequest, EngineFailed
from services.common.sample_count import sample_count_violations
from services.target.engine.sequence import FinishReason, SpeculationPlan, StepOutput

log = logging.getLogger(__name__)
tracer = trace.get_tracer("specmesh.target")

_FINISH = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP_SEQUENCE: common_pb2.FINISH_REASON_STOP_SEQUENCE,
}
RETRY_PUSHBACK_MS = 250
# EngineStats fields GetStats reports under the same names (services/target/engine/host_tier.py).
_HOST_TIER_STATS = ("host_tier_capacity_bytes", "host_tier_bytes", "host_tier_blocks", "host_tier_stored_blocks",
                    "host_tier_restored_blocks", "host_tier_restored_tokens", "host_tier_dropped_blocks",
                    "host_tier_rejected_blocks", "host_tier_store_seconds", "host_tier_restore_seconds")
SERVICE_NAME = target_service_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetService(target_service_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._in_flight = 0
        self._texts = TokenTexts(engine.tokenizer)  # token pieces of GenerateChunk.logprobs
        self._draining = False
        self._buckets = BucketLabels()

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "target is shutting down; retry another replica")
        await self._check_sizes(request, context)  # before any work: bounded by the limits
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), "INVALID_REQUEST", [
                Violation(f"sampling.{field}", message) for field, message in params_violations(request.sampling)])
        problems = routing_violations(request.speculation, request.bucket, request.priority)
        if problems:  # the router's fields, checked as the router checks them (services/common/request_checks.py)
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "; ".join(v.description for v in problems),
                        "INVALID_REQUEST", problems)
        bucket = self._buckets.label(request.bucket)  # a metric label: bounded cardinality
        n_problems = sample_count_violations(request.sampling.n, sampling.seed, self.engine.config.max_samples)
        if n_problems:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "; ".join(m for _, m in n_problems),
                        "INVALID_REQUEST", [Violation(field, message) for field, message in n_problems])
        if request.prompt and request.messages:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "set prompt or messages, not both")
        if not request.prompt and not request.messages:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        if request.tools and not request.messages:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tools need messages (a chat request)")
        grammar = await compile_constraint(self.engine.grammars, request.sampling, context)  # None: unconstrained
        request_id = request.request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()

        def emit(out: StepOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        # Tokenizing a large prompt takes a while: off the event loop, so other calls go on.
        if request.messages:
            try:
                prompt_ids = await asyncio.to_thread(chat_prompt_ids, self.engine.tokenizer, request.messages,
                                                     request.tools)
            except ChatTemplateError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        else:
            prompt_ids = await asyncio.to_thread(self.engine.tokenize, request.prompt)
        finished = submitted = False
        self._in_flight += 1
        # Spans are started without attaching them to the context: this is an async generator,
        # and a context attached across a `yield` cannot be detached when gRPC closes it.
        span = tracer.start_span("target.generate")
        in_span = trace.set_span_in_context(span)
        span.set_attribute("gen_ai.request.model", self.model_name)
        span.set_attribute("gen_ai.request.max_tokens", sampling.max_tokens)
        span.set_attribute("specmesh.bucket", bucket)
        phase, error = None, None
        try:
            try:
                self.engine.submit(request_id, prompt_ids, sampling, emit, request.tenant_salt,
                                   plan=_plan(request.speculation), bucket=bucket,
                                   span_context=span.get_span_context(), priority=request.priority,
                                   report_confidence=request.report_confidence, n=request.sampling.n,
                                   grammar=grammar)
                submitted = True
            except DuplicateRequest as exc:  # the original keeps streaming
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), "DUPLICATE_REQUEST_ID",
                            [Violation("request_id", str(exc))])
            except InvalidRequest as exc:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), "INVALID_REQUEST",
                            [Violation(exc.field, str(exc))] if exc.field else ())
            except EngineFailed as exc:  # the replica is going down: another one (or this, restarted)
                await abort(context, grpc.StatusCode.UNAVAILABLE, str(exc), "ENGINE_FAILED",
                            retry_after_s=RETRY_PUSHBACK_MS / 1000)
            except Overloaded as exc:
                # RetryInfo plus gRPC's standard pushback trailer, which retry policies honour.
                await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later",
                            "OVERLOADED", retry_after_s=RETRY_PUSHBACK_MS / 1000)
            span.set_attribute("gen_ai.usage.input_tokens", len(prompt_ids))
            out = await queue.get()  # the engine writes the `queue` and `prefill` spans
            phase = tracer.start_span("decode", context=in_span)
            while True:
                if out.error is not None:
                    await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {out.error}")
                if out.finish_reason is not None and not out.ends_request:  # one sample of several
                    yield target_service_pb2.TargetServiceGenerateResponse(chunk=common_pb2.GenerateChunk(
                        finish_reason=_FINISH[out.finish_reason], index=out.index))
                    out = await queue.get()
                    continue
                if out.finish_reason is not None:
                    finished = True
                    _record_usage(span, out)
                    yield target_service_pb2.TargetServiceGenerateResponse(chunk=_final_chunk(out))
                    return
                yield target_service_pb2.TargetServiceGenerateResponse(
                    chunk=common_pb2.GenerateChunk(text=out.text, token_ids=out.token_ids, index=out.index,
                                                   logprobs=logprobs_proto(out.logprobs, self._texts)))
                out = await queue.get()
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._in_flight -= 1
            if submitted and not finished:
                self.engine.abort(request_id)  # cancelled or failed: free its blocks now
                record_error(span, status_of(context, error))
            if phase is not None:
                phase.end()
            span.end()

    async def _check_sizes(self, request, context) -> None:
        """Prompt bytes and stop sequences within the limits (INVALID_ARGUMENT otherwise)."""
        problems = self.engine.config.limits.violations(
            [request.prompt, *(m.content for m in request.messages), *tool_texts(request)], request.sampling.stop,
            "messages" if request.messages else "prompt")
        if problems:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "; ".join(v.description for v in problems),
                        "REQUEST_TOO_LARGE", problems)

    async def GetStats(self, request, context):
        s = self.engine.stats()
        return target_service_pb2.GetStatsResponse(
            num_blocks=s.num_blocks, free_blocks=s.free_blocks, used_blocks=s.used_blocks,
            cached_blocks=s.cached_blocks, block_size=s.block_size, running_requests=s.running,
            waiting_requests=s.waiting, model=self.model_name, queued_tokens=s.queued_tokens,
            preemptions=s.num_preemptions, evictions=s.evictions,
            prefix_query_tokens=s.prefix_query_tokens, prefix_hit_tokens=s.prefix_hit_tokens,
            kv_bytes=s.kv_bytes, fragmentation=s.fragmentation, cache_model_id=self.engine.name,
            engine_alive=self.engine.alive, engine_error=str(self.engine.failure or ""),
            engine_steps=self.engine.num_steps,
            **{name: getattr(s, name) for name in _HOST_TIER_STATS})

    async def SubscribeKVEvents(self, request, context):
        log_ = self.engine.kv_events
        after = request.after_sequence
        need_snapshot = request.snapshot
        while not self._draining:
            events = None if need_snapshot else log_.since(after)
            if events is None:  # asked for, or a gap: send everything cached, then follow
                after, blocks = self.engine.kv_snapshot()
                yield target_service_pb2.SubscribeKVEventsResponse(
                    is_snapshot=True, snapshot_sequence=after,
                    snapshot_blocks=[_event_proto(0, b) for b in blocks])
                need_snapshot = False
            elif events:
                yield target_service_pb2.SubscribeKVEventsResponse(
                    events=[_event_proto(n, e) for n, e in events])
                after = events[-1][0]
            else:
                await log_.wait(after, timeout=0.5)

    async def drain(self) -> None:
        """Refuses new requests and waits for in-flight ones to finish."""
        self._draining = True
        while self._in_flight:
            await asyncio.sleep(0.05)


_EVENT_KINDS = {"stored": target_service_pb2.KV_EVENT_KIND_BLOCK_STORED,
                "removed": target_service_pb2.KV_EVENT_KIND_BLOCK_REMOVED}


def _event_proto(sequence: int, event) -> target_service_pb2.KVEvent:
    return target_service_pb2.KVEvent(
        sequence=sequence, kind=_EVENT_KINDS[event.kind], block_hash=event.block_hash,
        parent_hash=event.parent_hash or 0, num_tokens=event.num_tokens, scope=event.scope)


def _plan(message: common_pb2.SpeculationPlan) -> SpeculationPlan | None:
    """The router's plan within the draft's limits (checked by `routing_violations` first), or
    None for off / unspecified / depth 0."""
    plan = checked_plan(message)
    if plan.max_depth == 0:
        return None
    return SpeculationPlan(plan.method, plan.max_depth, plan.max_nodes, plan.load_aware, plan.acceptance_prior)


def _final_chunk(out: StepOutput) -> common_pb2.GenerateChunk:
    usage = common_pb2.Usage(prompt_tokens=out.prompt_tokens,
                             cached_prompt_tokens=out.cached_prompt_tokens,
                             host_cached_prompt_tokens=out.host_cached_prompt_tokens,
                             completion_tokens=out.completion_tokens)
    if out.speculation is not None:
        usage.proposed_tokens = out.speculation.proposed
        usage.accepted_tokens = out.speculation.accepted
        usage.rejected_tokens = out.speculation.rejected
        usage.acceptance_length = out.speculation.acceptance_length
        usage.verify_passes = out.speculation.verify_passes
        usage.fallback_steps = out.speculation.fallback_steps
    if out.confidence is not None:
        usage.mean_logprob = out.confidence.mean_logprob
        usage.min_logprob = out.confidence.min_logprob
        usage.mean_margin = out.confidence.mean_margin
    return common_pb2.GenerateChunk(text=out.text, token_ids=out.token_ids,
                                    finish_reason=_FINISH[out.finish_reason], usage=usage, index=out.index)


def _record_usage(span, out: StepOutput) -> None:
    span.set_attribute("gen_ai.usage.input_tokens", out.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", out.completion_tokens)
    span.set_attribute("gen_ai.usage.cached_input_tokens", out.cached_prompt_tokens)
    span.set_attribute("specmesh.usage.host_cached_input_tokens", out.host_cached_prompt_tokens)
    span.set_attribute("gen_ai.response.finish_reasons", [out.finish_reason.value])
    spec = out.speculation
    if spec is not None:
        span.set_attribute("specmesh.proposed_tokens", spec.proposed)
        span.set_attribute("specmesh.accepted_tokens", spec.accepted)
        span.set_attribute("specmesh.rejected_tokens", spec.rejected)
        span.set_attribute("specmesh.acceptance_length", spec.acceptance_length)
        span.set_attribute("specmesh.verify_passes", spec.verify_passes)
        span.set_attribute("specmesh.fallback_steps", spec.fallback_steps)


def add_to_server(server: grpc.aio.Server, service: TargetService) -> None:
    # Requests that do not parse (invalid UTF-8, truncated bytes) get INVALID_ARGUMENT.
    target_service_pb2_grpc.add_TargetServiceServicer_to_server(service, guard_malformed(server))
