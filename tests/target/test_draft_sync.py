"""The draft client alone knows which committed tokens the draft service holds of each
sequence: it is handed the whole history every step and sends only what the draft has not
seen; after a step that left the draft out of step (an answer past the deadline), it
releases the sequence and sends the whole history again, with the request's trace context."""

from __future__ import annotations

import asyncio
import time

from opentelemetry.trace import SpanContext, TraceFlags

from services.common.server import GrpcServer, ServerConfig
from services.draft.config import DraftConfig
from services.draft.service import SERVICE_NAME, DraftService, add_to_server
from services.target.speculation.draft_client import DraftClient, DraftRequest
from specmesh.proto.v1 import common_pb2

PL = common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP
SPAN = SpanContext(trace_id=0xA1, span_id=0xB2, is_remote=False, trace_flags=TraceFlags(1))
TRACEPARENT = f"00-{0xA1:032x}-{0xB2:016x}-01"


async def test_the_client_sends_what_the_draft_has_not_seen_and_resyncs_after_a_late_step():
    service = DraftService(DraftConfig())
    prepare, answer, sent, late = service.prepare, service.answer, [], []

    def recording_prepare(request, per_sequence=False):  # (new tokens, traceparent) the draft got
        sent.append([(list(s.new_token_ids), s.traceparent) for s in request.sequences])
        return prepare(request, per_sequence)

    def late_answer(prepared):
        if late:
            late.clear()
            time.sleep(1.0)  # past the client's 0.3 s deadline; the draft has appended the tokens
        return answer(prepared)
    service.prepare, service.answer = recording_prepare, late_answer
    server = GrpcServer(ServerConfig(port=0), lambda s: add_to_server(s, service), [SERVICE_NAME])
    await server.start()
    client = DraftClient(server.address, timeout_s=0.3, vocab_size=32)
    history = [1, 2, 3, 1, 2]

    async def step():
        return await asyncio.to_thread(client.propose, [DraftRequest("s", history, PL, 2, 2, "t", SPAN)])
    try:
        client.connect()
        for _ in range(100):
            if client.connected:
                break
            await asyncio.sleep(0.05)
        assert client.connected and client.synced_tokens("s") is None
        first = await step()
        assert first["s"] is not None and client.synced_tokens("s") == 5
        history += [3, 1]
        await step()
        assert sent[:2] == [[([1, 2, 3, 1, 2], TRACEPARENT)], [([3, 1], "")]]  # then only the new ones
        assert client.synced_tokens("s") == 7 and service.store.get("s").num_tokens == 7
        history += [2]
        late.append(True)
        assert await step() is None  # the whole step falls back
        assert client.synced_tokens("s") is None  # the draft may hold a history we did not see it take
        assert service.store.get("s").num_tokens == 8  # it did take the late tokens
        history += [3]
        resynced = await step()
        assert sent[3] == [(history, TRACEPARENT)]  # the whole history again ...
        assert service.store.get("s").num_tokens == 9  # ... after a Release, so nothing counted twice
        assert resynced["s"] is not None and client.synced_tokens("s") == 9
        client.release(["s"])
        assert client.synced_tokens("s") is None
    finally:
        client.close()
        await server.stop(0)
