"""What a caller with the router's certificate sends is checked at the target too
(services/common/request_checks.py): bad plans, priorities and buckets are refused or clamped,
and a concurrent victim's stream still gets its drafts. Real servers, mutual TLS, tiny model."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import details_of
from services.common.metrics import method_name
from services.common.request_checks import BucketLabels, OTHER_BUCKET, checked_plan
from services.common.speculation_plan import MAX_DEPTH, MAX_NODES
from services.common.tls import make_dev_certs
from specmesh.proto.v1 import common_pb2, target_service_pb2
from tests.mesh import start_draft, start_mesh

PL = common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP
PROMPT = "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("mesh-certs"))


def _request(request_id: str, max_tokens: int = 24, method: int = PL, max_depth: int = 4,
             bucket: str = "chat-short-greedy", priority: int = 0):
    return target_service_pb2.TargetServiceGenerateRequest(
        request_id=request_id, prompt=PROMPT, tenant_salt="salt-a", bucket=bucket, priority=priority,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
        speculation=common_pb2.SpeculationPlan(method=method, max_depth=max_depth, max_nodes=max_depth))


async def _run(stub, req):
    """(token ids, final chunk) of one Generate call on the target."""
    ids, last = [], None
    async for response in stub.Generate(req, timeout=60):
        ids.extend(response.chunk.token_ids)
        last = response.chunk
    return ids, last


async def _refusal(stub, req) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _run(stub, req)
    return info.value


async def test_bad_plans_with_the_routers_certificate_are_refused_or_clamped_and_harm_no_one(
        tiny_llama_dir, certs):
    draft = await start_draft(tls_dir=certs)
    mesh = await start_mesh(tiny_llama_dir, tls_dir=certs, draft_address=draft.address,
                            draft_timeout_s=5.0)
    stub = mesh.target_stub()  # presents the router's certificate
    try:
        alone, _ = await _run(stub, _request("alone", 40))
        victim = stub.Generate(_request("victim", 40), timeout=60)
        first = await victim.read()  # the victim streams while the bad requests arrive
        deep = asyncio.create_task(_run(stub, _request("deep", 24, max_depth=1000)))
        unknown = await _refusal(stub, _request("method-99", method=99))
        huge_bucket = await _refusal(stub, _request("bucket", bucket="b" * 10_000))
        priority = await _refusal(stub, _request("priority", priority=1000))
        negative = await _refusal(stub, _request("negative", max_depth=-3))
        victim_ids, last = list(first.chunk.token_ids), first.chunk
        while (response := await victim.read()) is not grpc.aio.EOF:
            victim_ids.extend(response.chunk.token_ids)
            last = response.chunk
        deep_ids, deep_last = await deep

        assert victim_ids == alone  # greedy: the same tokens as when it ran alone
        assert last.usage.proposed_tokens > 0 and last.usage.fallback_steps == 0  # its drafts, every step
        assert deep_last.usage.proposed_tokens > 0  # clamped to the draft's limit, so it speculates too
        assert deep_last.usage.fallback_steps == 0
        for error, field in ((unknown, "speculation.method"), (huge_bucket, "bucket"),
                             (priority, "priority"), (negative, "speculation.max_depth")):
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert [v.field for v in details_of(error)["BadRequest"].field_violations][:1] == [field]
        assert "unknown speculation method 99" in unknown.details()
        after, after_last = await _run(stub, _request("after", 40))  # still serving, still speculating
        assert after == alone and after_last.usage.proposed_tokens > 0
        stats = await stub.GetStats(target_service_pb2.GetStatsRequest(), timeout=5)
        assert stats.engine_alive and stats.engine_error == ""
    finally:
        await mesh.stop()
        await draft.stop(0)


def test_plans_are_clamped_to_the_drafts_limits():
    plan = checked_plan(common_pb2.SpeculationPlan(method=PL, max_depth=1000, max_nodes=5000))
    assert (plan.max_depth, plan.max_nodes) == (MAX_DEPTH, MAX_NODES)
    off = checked_plan(common_pb2.SpeculationPlan(method=common_pb2.SPECULATION_METHOD_OFF, max_depth=4))
    assert off.max_depth == 0
    assert checked_plan(common_pb2.SpeculationPlan(method=PL, max_depth=3, acceptance_prior=float("nan"))
                        ).acceptance_prior == 0.0


def test_metric_labels_never_raise_and_stay_bounded():
    assert method_name(99) == "unknown" and method_name(PL) == "prompt_lookup"
    labels = BucketLabels(max_labels=2)
    assert [labels.label(b) for b in ("a", "b", "c", "a", "d")] == ["a", "b", OTHER_BUCKET, "a", OTHER_BUCKET]
