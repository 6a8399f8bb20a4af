"""A draft Release that times out is retried, and the draft service expires
sequences nobody releases, so they never pile up toward its sequence limit."""

from __future__ import annotations

import asyncio

from specmesh.proto.v1 import common_pb2, draft_service_pb2
from services.common.server import GrpcServer, ServerConfig
from services.draft.config import DraftConfig
from services.draft.service import SERVICE_NAME, DraftService, add_to_server
from services.draft.state import DraftStateStore
from tests.mesh import collect, request, start_mesh


async def test_a_timed_out_release_is_retried_until_the_draft_holds_nothing(tiny_llama_dir):
    service = DraftService(DraftConfig(server=ServerConfig(port=0), draft_model_dir=tiny_llama_dir,
                                       draft_model_dtype="float32"))
    release, calls = service.Release, []

    async def lost_first_release(request, context):  # the first Release times out, unapplied
        calls.append(list(request.sequence_ids))
        if len(calls) == 1:
            await asyncio.sleep(4.0)
            return draft_service_pb2.ReleaseResponse()
        return await release(request, context)
    service.Release = lost_first_release
    draft = GrpcServer(ServerConfig(port=0), lambda s: add_to_server(s, service), [SERVICE_NAME])
    await draft.start()
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address, draft_timeout_s=2.0,
                            speculation={"speculation_method": "draft_model", "speculation_depth": 3})
    client = mesh.engine.speculator.client
    try:
        prompt = "1 2 3 4 1 2 3 4 1 2 3 4 1 2"
        first = await collect(mesh.router_stub, request(prompt, 12))
        assert first[2].usage.proposed_tokens > 0
        for _ in range(200):  # the first Release times out on the target's side
            if calls and client.num_unreleased == 1 and not client._releasing:
                break
            await asyncio.sleep(0.05)
        assert len(service.store) == 1  # the finished sequence still holds draft state
        second = await collect(mesh.router_stub, request(prompt + " 3", 12))
        assert second[2].usage.proposed_tokens > 0
        for _ in range(100):
            if len(service.store) == 0 and client.num_unreleased == 0:
                break
            await asyncio.sleep(0.05)
        assert len(service.store) == 0 and client.num_unreleased == 0
        assert calls[1][0] == calls[0][0]  # the retry carried the lost one
    finally:
        await mesh.stop()
        await draft.stop(grace=0.1)


def _propose(service: DraftService, sequence_id: str, tokens: list[int]) -> None:
    service.propose(draft_service_pb2.ProposeRequest(step=1, sequences=[draft_service_pb2.DraftSequence(
        sequence_id=sequence_id, new_token_ids=tokens, method=common_pb2.SPECULATION_METHOD_SUFFIX,
        max_depth=2, tenant_salt="t")]))


def test_sequences_idle_past_the_ttl_are_released():
    now = [0.0]
    service = DraftService(DraftConfig(server=ServerConfig(port=0), sequence_ttl_s=60.0, max_sequences=2))
    service.store = DraftStateStore(clock=lambda: now[0])
    _propose(service, "leaked", [1, 2, 3])
    now[0] = 30.0
    _propose(service, "live", [4, 5, 6])
    now[0] = 61.0
    _propose(service, "live", [7])  # touched: stays
    _propose(service, "new", [8, 9])  # "leaked" (idle 61 s) expires, so this fits in the limit
    assert "leaked" not in service.store
    assert [s for s in ("live", "new") if s in service.store] == ["live", "new"]
    assert service.store.idle(60.0) == []
    now[0] = 200.0
    assert service.store.idle(60.0) == ["live", "new"]  # least recently used first
    assert service.expire() == 2 and len(service.store) == 0
