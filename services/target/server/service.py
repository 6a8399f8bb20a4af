"""gRPC TargetService: streams a request through the engine.

`Generate` is three steps: admit (the request contract of services/common/request_checks.py,
the same checks the router ran, then the fields the router decides, the constraint compiled
and the prompt tokenized), submit (the engine queues the request or refuses it) and stream
(the engine's outputs as chunks). The request id is the router's; a direct caller that sends
none gets one minted here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from specmesh.proto.v1 import (
    common_pb2,
    target_service_pb2,
    target_service_pb2_grpc,
)
from services.common.errors import Refusal, Violation, abort, abort_refusal, guard_malformed
from services.common.metrics_interceptor import status_of
from services.common.request_checks import (BucketLabels, CheckedRequest, check_request, checked_plan, refusal,
                                            routing_violations)
from services.common.telemetry import record_error
from services.target.server.chat import ChatTemplateError, chat_prompt_ids
from services.target.server.logprob_chunks import TokenTexts, logprobs_proto
from services.target.structured.request import compile_constraint
from services.target.engine.engine import Engine, InvalidRequest, Overloaded
from services.target.engine.loop_mailbox import mailbox_for
from services.target.engine.engine_types import DuplicateRequest, EngineFailed, RankLost
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
                    "host_tier_rejected_blocks", "host_tier_store_seconds", "host_tier_restore_seconds",
                    "shared_tier_capacity_bytes", "shared_tier_bytes", "shared_tier_written_blocks",
                    "shared_tier_deleted_blocks", "shared_tier_dropped_writes", "shared_tier_loaded_blocks",
                    "shared_tier_restored_blocks", "shared_tier_restored_tokens", "shared_tier_rejected_blocks",
                    "shared_tier_errors", "shared_tier_write_seconds", "shared_tier_load_seconds",
                    "recompute_seconds_per_block", "swap_preemptions", "recompute_preemptions",
                    "host_tier_swap_bytes", "host_tier_swapped_out_blocks", "host_tier_swapped_in_blocks",
                    "host_tier_swap_out_seconds", "host_tier_swap_in_seconds", "swap_seconds_per_block",
                    "host_tier_cold_precision", "host_tier_cold_blocks", "host_tier_cold_bytes",
                    "host_tier_cold_stored_blocks", "host_tier_cold_restored_blocks", "host_tier_cold_setting",
                    "host_tier_cold_reason", "host_tier_restore_bytes", "host_tier_cold_swapped_out_blocks",
                    "host_tier_restore_bandwidth", "kv_block_bytes")
SERVICE_NAME = target_service_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


@dataclass(frozen=True)
class Admitted:
    """A request that passed every check before the engine, ready to submit."""

    request_id: str
    prompt_ids: list[int]
    checked: CheckedRequest  # the sampling parsed once, the sample count, the constraint
    grammar: object | None  # the compiled constraint; None = unconstrained
    plan: SpeculationPlan | None
    bucket: str  # as a metric label (bounded cardinality)
    request: target_service_pb2.TargetServiceGenerateRequest  # priority, tenant salt, report_confidence


class Outputs:
    """One request's engine outputs, handed from the engine's thread to the call's event loop."""

    def __init__(self) -> None:
        self._mailbox = mailbox_for(asyncio.get_running_loop())  # a step's outputs wake the loop once
        self._queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self.finished = False  # the final output went out: nothing left to abort

    def emit(self, out: StepOutput) -> None:  # on the engine's thread
        self._mailbox.post(self._queue, out)

    async def next(self) -> StepOutput:
        return await self._queue.get()


class TargetService(target_service_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._in_flight = 0
        self._texts = TokenTexts(engine.tokenizer)  # token pieces of GenerateChunk.logprobs
        self._draining = False
        self._buckets = BucketLabels()

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        admitted = await self._admit(request, context)
        self._in_flight += 1
        # Spans are started without attaching them to the context: this is an async generator,
        # and a context attached across a `yield` cannot be detached when gRPC closes it.
        span = tracer.start_span("target.generate", attributes={
            "gen_ai.request.model": self.model_name, "gen_ai.request.max_tokens": admitted.checked.sampling.max_tokens,
            "specmesh.bucket": admitted.bucket, "specmesh.request_id": admitted.request_id})
        outputs, error = None, None
        try:
            outputs = await self._submit(admitted, span, context)
            async with contextlib.aclosing(self._stream(outputs, span, context)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._in_flight -= 1
            if outputs is not None and not outputs.finished:
                self.engine.abort(admitted.request_id)  # cancelled or failed: free its blocks now
                record_error(span, status_of(context, error))
            span.end()

    async def _admit(self, request, context) -> Admitted:
        """Every check before any work, then the prompt's token ids. The contract's refusals
        are the router's own: the same status, message and field violations."""
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "target is shutting down; retry another replica")
        config = self.engine.config
        try:
            checked = check_request(request, config.limits, config.max_tokens_limit, config.max_samples)
            problems = routing_violations(request.speculation, request.bucket, request.priority)
            if problems:  # the fields the router decides, checked with the router's own functions
                raise refusal(problems, "INVALID_REQUEST")
        except Refusal as refused:
            await abort_refusal(context, refused)
        grammar = await compile_constraint(self.engine.grammars, checked.constraint, context)
        return Admitted(request.request_id or uuid.uuid4().hex,  # minted here only for a direct call without one
                        await self._prompt_ids(request, context), checked, grammar, _plan(request.speculation),
                        self._buckets.label(request.bucket), request)

    async def _prompt_ids(self, request, context) -> list[int]:
        """The prompt (or the chat, through the model's template) as token ids, off the event
        loop: other calls go on while a large prompt is tokenized."""
        if not request.messages:
            return await asyncio.to_thread(self.engine.tokenize, request.prompt)
        try:
            return await asyncio.to_thread(chat_prompt_ids, self.engine.tokenizer, request.messages, request.tools)
        except ChatTemplateError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _submit(self, admitted: Admitted, span, context) -> Outputs:
        """Queues the request on the engine; the engine's refusals become gRPC statuses."""
        outputs, request = Outputs(), admitted.request
        if self.engine.blocks.shared_tier is not None:  # blocks another replica computed: into the host tier first
            await asyncio.to_thread(self.engine.prefetch_shared, admitted.prompt_ids, request.tenant_salt)
        try:
            self.engine.submit(admitted.request_id, admitted.prompt_ids, admitted.checked.sampling, outputs.emit,
                               request.tenant_salt, plan=admitted.plan, bucket=admitted.bucket,
                               span_context=span.get_span_context(), priority=request.priority,
                               report_confidence=request.report_confidence, n=admitted.checked.n,
                               grammar=admitted.grammar)
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
        span.set_attribute("gen_ai.usage.input_tokens", len(admitted.prompt_ids))
        return outputs

    async def _stream(self, outputs: Outputs, span, context):
        """The engine's outputs as response chunks, up to the request's final one."""
        out = await outputs.next()  # the engine writes the `queue` and `prefill` spans
        phase = tracer.start_span("decode", context=trace.set_span_in_context(span))
        try:
            while True:
                if out.error is not None:  # a lost rank: nothing wrong with the request, another replica serves it
                    code = grpc.StatusCode.UNAVAILABLE if isinstance(out.error, RankLost) else grpc.StatusCode.INTERNAL
                    await context.abort(code, f"generation failed: {out.error}")
                if out.finish_reason is not None and out.ends_request:
                    outputs.finished = True
                    _record_usage(span, out)
                    yield target_service_pb2.TargetServiceGenerateResponse(chunk=_final_chunk(out))
                    return
                if out.finish_reason is not None:  # one sample of several
                    chunk = common_pb2.GenerateChunk(finish_reason=_FINISH[out.finish_reason], index=out.index)
                else:
                    chunk = common_pb2.GenerateChunk(text=out.text, token_ids=out.token_ids, index=out.index,
                                                     logprobs=logprobs_proto(out.logprobs, self._texts))
                yield target_service_pb2.TargetServiceGenerateResponse(chunk=chunk)
                out = await outputs.next()
        finally:
            phase.end()

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
_TIERS = {"device": target_service_pb2.KV_TIER_DEVICE, "host": target_service_pb2.KV_TIER_HOST,
          "shared": target_service_pb2.KV_TIER_SHARED}


def _event_proto(sequence: int, event) -> target_service_pb2.KVEvent:
    return target_service_pb2.KVEvent(
        sequence=sequence, kind=_EVENT_KINDS[event.kind], block_hash=event.block_hash,
        parent_hash=event.parent_hash or 0, num_tokens=event.num_tokens, scope=event.scope,
        tier=_TIERS[event.tier])


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
                             shared_cached_prompt_tokens=out.shared_cached_prompt_tokens,
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
    span.set_attribute("specmesh.usage.shared_cached_input_tokens", out.shared_cached_prompt_tokens)
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
