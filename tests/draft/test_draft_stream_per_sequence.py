"""On ProposeStream one bad sequence gets its own refusal (no tree, nothing kept of it) and
the other sequences of the same batched message get their drafts; the stream goes on."""

from __future__ import annotations

import grpc

from services.common.server import GrpcServer, ServerConfig
from services.draft.config import DraftConfig
from services.draft.service import SERVICE_NAME, DraftService, add_to_server
from specmesh.proto.v1 import common_pb2, draft_service_pb2, draft_service_pb2_grpc

PL = common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP


def _seq(sequence_id: str, max_depth: int = 2, tenant: str = "a", tokens=(1, 2, 3, 1, 2)):
    return draft_service_pb2.DraftSequence(sequence_id=sequence_id, new_token_ids=list(tokens), method=PL,
                                           max_depth=max_depth, tenant_salt=tenant)


async def test_a_bad_sequence_in_a_batched_stream_message_costs_only_itself():
    service = DraftService(DraftConfig(max_sequences=3))
    server = GrpcServer(ServerConfig(port=0), lambda s: add_to_server(s, service), [SERVICE_NAME])
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stream = draft_service_pb2_grpc.DraftServiceStub(channel).ProposeStream(timeout=10)
            await stream.write(draft_service_pb2.ProposeStreamRequest(step=1, sequences=[
                _seq("good"), _seq("too-deep", max_depth=398), _seq("other-tenant-later")]))
            first = await stream.read()
            assert first.step == 1
            assert {t.sequence_id: list(t.token_ids) for t in first.trees} == {
                "good": [3, 1], "other-tenant-later": [3, 1]}
            assert "too-deep" not in service.store  # refused: nothing kept of it
            # Another tenant's id, and more new sequences than the limit (3 open max): refused
            # one by one, the known sequence still gets its tree.
            await stream.write(draft_service_pb2.ProposeStreamRequest(step=2, sequences=[
                _seq("good", tokens=[3]), _seq("other-tenant-later", tenant="b", tokens=[3]),
                _seq("new-1"), _seq("new-2")]))
            second = await stream.read()
            assert {t.sequence_id: list(t.token_ids) for t in second.trees} == {"good": [1, 2], "new-1": [3, 1]}
            await stream.done_writing()
            assert await stream.read() is grpc.aio.EOF  # the stream ended normally
        # Unary Propose still refuses the whole request.
        assert len(service.store) == 3
    finally:
        await server.stop(0)
