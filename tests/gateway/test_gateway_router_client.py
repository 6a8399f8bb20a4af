"""The gateway calls the router through the shipped client (specmesh.client): a failure before
the first response is retried after a short pushback, with the caller's own credential each
time; a longer pushback goes back to the HTTP caller at once; an answer that failed after
streaming is never sent again."""

from __future__ import annotations

import json

import aiohttp
import grpc

from services.gateway.app import Gateway, GatewayConfig
from tests.scripted_router import serve

BODY = {"model": "default", "prompt": "hi", "max_tokens": 2}
AUTH = {"Authorization": "Bearer caller-token"}


async def _post(script, body: dict) -> tuple[int, dict, str, list]:
    """(HTTP status, headers, body text, the router's calls' credentials) of one completion."""
    server, router, address = await serve(script)
    gateway = Gateway(GatewayConfig(port=0, router_address=address, timeout_s=5.0))
    await gateway.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://{gateway.address}/v1/completions", json=body, headers=AUTH) as response:
                return response.status, dict(response.headers), await response.text(), router.tokens
    finally:
        await gateway.stop()
        await server.stop(None)


async def test_unavailable_before_the_first_response_is_retried_with_the_callers_credential():
    status, _, text, calls = await _post([(grpc.StatusCode.UNAVAILABLE, "50"), ["a", "b"]], BODY)
    assert status == 200
    answer = json.loads(text)
    assert (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == ("ab", "length")
    assert calls == ["Bearer caller-token"] * 2


async def test_a_pushback_longer_than_the_gateway_waits_is_a_429_at_once():
    status, headers, text, calls = await _post([(grpc.StatusCode.RESOURCE_EXHAUSTED, "5000")], BODY)
    assert status == 429 and headers["Retry-After"] == "5"
    assert json.loads(text)["error"]["type"] == "rate_limit_error"
    assert len(calls) == 1


async def test_a_stream_that_fails_after_its_first_token_is_not_sent_again():
    status, _, text, calls = await _post([{"texts": ["a"], "then": grpc.StatusCode.UNAVAILABLE}],
                                         {**BODY, "stream": True})
    assert status == 200  # the events had begun
    events = [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == "a"
    assert events[-1]["error"]["type"] == "service_unavailable"
    assert "[DONE]" not in text
    assert len(calls) == 1
