"""Arbitrary GenerateRequest messages and raw byte strings sent through the router
to a tiny-model mesh, while another tenant streams: no INTERNAL or UNKNOWN, the other
tenant's streams complete unchanged, and the mesh keeps serving.

Hypothesis runs in a worker thread (it is synchronous); each example's call runs on the
test's event loop, where the servers live.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmesh.proto.v1 import common_pb2, router_service_pb2
from tests.mesh import AUTH_A, AUTH_B, collect, request, start_mesh

FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
OTHER_PROMPT = "Tenant B asks a long and steady question about"
EXAMPLES = 25  # requests and byte strings each: about 30 s of CPU time

_int32 = st.integers(-2**31, 2**31 - 1)
_float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
_text = st.text(max_size=80)
sampling_params = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.one_of(st.integers(-2, 6), _int32),
    temperature=st.one_of(st.sampled_from([0.0, 1e-40, 1e-45, 0.7, 3e38]), _float32),
    top_k=st.one_of(st.sampled_from([0, 1, 2**31 - 1]), _int32),
    top_p=st.one_of(st.sampled_from([0.0, 1e-30, 0.9, 1.0]), _float32),
    seed=st.integers(0, 2**64 - 1), has_seed=st.booleans(),
    stop=st.lists(st.text(max_size=12), max_size=20))
chat_messages = st.lists(st.builds(common_pb2.ChatMessage, role=st.sampled_from(["user", "system", "x", ""]),
                                   content=_text), max_size=3)
generate_requests = st.builds(
    router_service_pb2.GenerateRequest,
    prompt=st.one_of(_text, st.just("")), sampling=sampling_params,
    model=st.sampled_from(["", "default", "unknown-pool"]),
    messages=st.one_of(st.just([]), chat_messages))


async def _code(make_call) -> grpc.StatusCode:
    """Runs the call `make_call()` starts (on the event loop) to its end; its status code."""
    try:
        async for _ in make_call():
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")  # servers draw random ids
async def test_arbitrary_requests_never_fail_another_tenant_or_the_server(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir)
    loop = asyncio.get_running_loop()
    raw = mesh.channel.unary_stream("/specmesh.v1.RouterService/Generate",
                                    request_serializer=None, response_deserializer=None)
    try:
        expected = (await collect(mesh.router_stub, request(OTHER_PROMPT, 48), metadata=AUTH_B))[0]
        searching, others = True, []

        async def other_tenant():
            while searching:  # tenant B streams the whole time, one request after another
                others.append((await collect(mesh.router_stub, request(OTHER_PROMPT, 48), metadata=AUTH_B))[0])
        background = asyncio.ensure_future(other_tenant())

        def call(coro) -> grpc.StatusCode:
            return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(generate_requests)
        def requests_are_answered(req):
            code = call(_code(lambda: mesh.router_stub.Generate(req, metadata=AUTH_A, timeout=60)))
            assert code not in FORBIDDEN, (code, req)

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.binary(max_size=200))
        def bytes_are_answered(payload):
            code = call(_code(lambda: raw(payload, metadata=AUTH_A, timeout=60)))
            assert code not in FORBIDDEN, (code, payload)

        await asyncio.to_thread(requests_are_answered)
        await asyncio.to_thread(bytes_are_answered)
        searching = False
        await background
        assert others and all(tokens == expected for tokens in others)
        health = await health_pb2_grpc.HealthStub(mesh.channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        _, _, last = await collect(mesh.router_stub, request("still serving", 4))
        assert last.usage.completion_tokens == 4
        stats = mesh.engine.stats()
        assert stats.running == 0 and stats.waiting == 0
    finally:
        await mesh.stop()
