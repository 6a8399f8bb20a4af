"""The OpenAI-compatible HTTP gateway: a thin aiohttp server in front of the router.

    POST /v1/chat/completions   chat (messages), streaming (SSE) or not
    POST /v1/completions        plain prompt, streaming (SSE) or not
    GET  /v1/models             the router's model pools
    GET  /healthz               200 when the gateway runs (it does not call the router)

The caller's `Authorization: Bearer ...` header is passed to the router as gRPC metadata;
the router authenticates. Router errors come back as OpenAI-style JSON errors with the
matching HTTP status (services/gateway/openai_api.py ERRORS). The gateway holds no model
and no state beyond its router client: the shipped `specmesh.client.AsyncClient`, whose
retries (GATEWAY_RETRY) cover a failure before the first response only, so a streamed
answer is never sent twice.

aiohttp because it is one well-kept dependency that serves HTTP (with streaming responses)
on the same asyncio loop as grpc.aio, with no separate ASGI server process.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import grpc
from aiohttp import web

from specmesh.client import AsyncClient, RetryPolicy
from services.gateway.openai_api import (
    Answer,
    BadRequest,
    Parsed,
    error_body,
    grpc_error,
    parse_chat,
    parse_completion,
)

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 * 1024 * 1024
# Retries of UNAVAILABLE / RESOURCE_EXHAUSTED before the first response: a short pushback (a
# target's overload, a router restarting) is waited here; a longer one (a tenant's quota) goes
# back to the HTTP caller at once as 429 / 503 with Retry-After.
GATEWAY_RETRY = RetryPolicy(max_attempts=3, max_pushback_s=1.0)


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (tests)
    router_address: str = "127.0.0.1:50051"
    router_ca_pem: bytes | None = None  # verify the router's public TLS with this CA; None = plaintext
    timeout_s: float = 600.0  # deadline of one router call, over all its attempts
    models_timeout_s: float = 10.0
    retry: RetryPolicy = GATEWAY_RETRY

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.router_address:
            raise ValueError("router_address must not be empty")
        if self.timeout_s <= 0 or self.models_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")


class Gateway:
    """Owns the HTTP site and the router client. `start()`, then `address`, then `stop()`."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._runner: web.AppRunner | None = None
        self._router: AsyncClient | None = None
        self.port = config.port

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        self._router = AsyncClient(self.config.router_address, ca_pem=self.config.router_ca_pem,
                                   timeout=self.config.timeout_s, retry=self.config.retry)
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
        app.add_routes([web.post("/v1/chat/completions", self._chat),
                        web.post("/v1/completions", self._completions),
                        web.get("/v1/models", self._models),
                        web.get("/healthz", self._health)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the bound port when port=0

    async def stop(self, grace: float = 5.0) -> None:
        if self._runner is not None:
            await self._runner.shutdown()
            await self._runner.cleanup()
        if self._router is not None:
            await self._router.close(grace)

    # ---- handlers ---------------------------------------------------------------
    async def _chat(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, parse_chat)

    async def _completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, parse_completion)

    async def _models(self, http: web.Request) -> web.Response:
        try:
            response = await self._router.list_models(self.config.models_timeout_s, metadata=_auth(http))
        except grpc.aio.AioRpcError as exc:
            return _error_response(*grpc_error(exc))
        data = [{"id": p.name, "object": "model", "created": 0, "owned_by": "specmesh"} for p in response.pools]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, http: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _generate(self, http: web.Request, parse) -> web.StreamResponse:
        try:
            body = await http.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error_response(400, error_body("the body is not valid JSON", "invalid_request_error"))
        if not isinstance(body, dict):
            return _error_response(400, error_body("the body must be a JSON object", "invalid_request_error"))
        try:
            parsed = parse(body)
        except BadRequest as exc:
            return _error_response(400, error_body(str(exc), "invalid_request_error", param=exc.param))
        responses = self._router.stream(parsed.request, metadata=_auth(http))
        try:
            if parsed.stream:
                return await _stream(http, responses, parsed)
            answer = Answer(parsed)
            async for response in responses:
                answer.add(response.chunk)
            return web.json_response(answer.full())
        except grpc.aio.AioRpcError as exc:
            return _error_response(*grpc_error(exc))
        finally:
            await responses.aclose()  # ends the call: a client that went away frees the router's work


async def _stream(http: web.Request, iterator, parsed: Parsed) -> web.StreamResponse:
    """Server-sent events as OpenAI sends them. Errors before the first token are plain HTTP
    errors; after it, an `error` event and the end of the stream (never a silent [DONE])."""
    answer = Answer(parsed)
    try:
        first = await iterator.__anext__()  # the router's errors arrive before any token
    except StopAsyncIteration:
        first = None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(http)
    started: set[int] = set()  # choices (samples) that sent their first event
    try:
        pending = [first] if first is not None else []
        while True:
            for item in pending:
                chunk = item.chunk
                content, deltas = answer.add(chunk)
                finish = answer.finish_reasons.get(chunk.index) if chunk.finish_reason else None
                if answer.tools is not None:  # one choice: content and tool-call deltas (tool_calls.py)
                    for event in answer.events(content, deltas, 0 not in started, finish):
                        await _send(response, event)
                        started.add(0)
                elif chunk.text or chunk.index not in started or finish:
                    await _send(response, answer.delta(chunk.text, first=chunk.index not in started,
                                                       finish_reason=finish, index=chunk.index))
                    started.add(chunk.index)
            try:
                pending = [await iterator.__anext__()]
            except StopAsyncIteration:
                break
        if parsed.include_usage and answer.usage is not None:
            await _send(response, answer.usage_event())
        await response.write(b"data: [DONE]\n\n")
    except grpc.aio.AioRpcError as exc:
        _, body, _ = grpc_error(exc)
        await _send(response, body)
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client went away; the caller cancels the router call
    await response.write_eof()
    return response


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")


def _auth(http: web.Request) -> tuple[tuple[str, str], ...]:
    header = http.headers.get("Authorization", "")
    return (("authorization", header),) if header else ()


def _error_response(status: int, body: dict, headers: dict | None = None) -> web.Response:
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own errors (404, 405, body too large) as OpenAI-style JSON too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return _error_response(exc.status, error_body(exc.reason, kind))
