"""A light client for the specmesh router: needs only grpcio and protobuf (no torch).

    from specmesh.client import Client

    with Client("127.0.0.1:50051", token="specmesh-dev-token") as client:
        for chunk in client.chat([{"role": "user", "content": "Why is the sky blue?"}]):
            print(chunk.text, end="", flush=True)

`AsyncClient` has the same methods as async iterators / coroutines. `stream(request)` sends a
GenerateRequest built by the caller and yields the router's responses as they are (route
record included), with the same retries; `metadata=` replaces the client's token for one call
(a gateway passes each caller's own credential).

Agents share tool executions through the router's tool-result cache (scoped to the token's
tenant): `cached_tool_call(tool, arguments, compute)` returns the stored result, or waits for
another caller computing the same (tool, version, arguments), or computes it with `compute`
and stores it (a raised exception is stored as a short-lived error and re-raised). Every call has a
deadline (`timeout`, over all attempts). A call that fails with UNAVAILABLE or
RESOURCE_EXHAUSTED before its first token is retried: after the server's
`grpc-retry-pushback-ms` hint when it sent one (a negative hint means "do not retry"),
else after an exponential backoff with jitter. A failure after tokens were streamed is
raised, never retried (the answer would repeat). Errors are `grpc.RpcError`s.

The retry loop is ours rather than gRPC's service-config retry policy so that one
deadline spans all attempts, the sync and async clients behave alike, and the delay
actually taken is visible (`RetryPolicy.sleep`) to tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import grpc

from specmesh.proto.v1 import cache_service_pb2, common_pb2, router_service_pb2, router_service_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
Metadata = tuple[tuple[str, str], ...]
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
           common_pb2.FINISH_REASON_LENGTH: "length"}

Message = Mapping[str, str]  # {"role": ..., "content": ...}
HIT, WAITED, COMPUTED = "hit", "waited", "computed"  # ToolResult.outcome
_LEASE = cache_service_pb2.TOOL_LOOKUP_OUTCOME_LEASE_GRANTED
_OUTCOME = {cache_service_pb2.TOOL_LOOKUP_OUTCOME_HIT: HIT, cache_service_pb2.TOOL_LOOKUP_OUTCOME_WAITED: WAITED}


@dataclass(frozen=True)
class Chunk:
    """Text and token ids committed since the previous chunk; the last one has finish_reason
    ("stop", "stop_sequence", "length") and usage."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: common_pb2.Usage | None = None


@dataclass(frozen=True)
class ToolResult:
    """A tool call's result: `value`, and whether it was a cache hit, waited for another
    caller's computation, or computed by this call."""

    value: bytes
    outcome: str


class ToolCallError(Exception):
    """The tool failed (now or, cached briefly, for another caller)."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4  # 1 = no retries
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    max_pushback_s: float = 30.0  # a larger hint is taken as "do not retry"

    def delay(self, attempt: int, error: grpc.RpcError) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None to give up."""
        if error.code() not in RETRYABLE or attempt >= self.max_attempts:
            return None
        hint = pushback_s(error)
        if hint is not None:
            return hint if 0 <= hint <= self.max_pushback_s else None
        backoff = min(self.initial_backoff_s * self.multiplier ** (attempt - 1), self.max_backoff_s)
        return random.uniform(0, backoff)  # full jitter


NO_RETRIES = RetryPolicy(max_attempts=1)  # measurements and health checks: a retry would hide a failure


def pushback_s(error: grpc.RpcError) -> float | None:
    """The server's `grpc-retry-pushback-ms` hint in seconds (negative = do not retry)."""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-retry-pushback-ms":
            try:
                return int(value) / 1000
            except ValueError:
                return -1.0  # malformed: gRPC's rule is not to retry
    return None


@dataclass
class _Options:
    address: str
    token: str | None
    ca_pem: bytes | None
    timeout: float
    retry: RetryPolicy
    sleep: Callable[[float], object] | None = None  # tests: observe the delays taken

    def metadata(self, override: Metadata | None = None) -> Metadata:
        if override is not None:
            return override
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


class AsyncClient:
    """Async client; use `async with AsyncClient(...) as client:` or call `close()`."""

    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None, *, ca_pem: bytes | None = None,
                 timeout: float = 300.0, retry: RetryPolicy = RetryPolicy(),
                 sleep: Callable[[float], object] | None = None) -> None:
        self._o = _Options(address, token, ca_pem, timeout, retry, sleep)
        if ca_pem is not None:
            self._channel = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca_pem))
        else:
            self._channel = grpc.aio.insecure_channel(address)
        self._stub = router_service_pb2_grpc.RouterServiceStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self, grace: float | None = None) -> None:
        """Closes the channel; with `grace`, calls in flight get that many seconds to finish."""
        await self._channel.close(grace)

    def generate(self, prompt: str, **sampling) -> AsyncIterator[Chunk]:
        """Streams the completion of a plain prompt. Keywords: max_tokens, temperature, top_k,
        top_p, seed, stop, model, timeout."""
        return self._chunks(build_request(prompt=prompt, **sampling), sampling.get("timeout"))

    def chat(self, messages: Iterable[Message], **sampling) -> AsyncIterator[Chunk]:
        """Streams the answer to a conversation (the model's chat template is applied)."""
        return self._chunks(build_request(messages=messages, **sampling), sampling.get("timeout"))

    def stream(self, request: router_service_pb2.GenerateRequest, *, metadata: Metadata | None = None,
               timeout: float | None = None) -> AsyncIterator[router_service_pb2.GenerateResponse]:
        """The router's responses to `request` as they are; retried as `generate` is. Close the
        iterator (or read it to the end) to end the call."""
        return self._stream(request, timeout, metadata)

    async def complete(self, prompt: str | None = None, messages: Iterable[Message] | None = None,
                       **sampling) -> Chunk:
        """The whole answer as one Chunk (text and ids joined; finish_reason and usage of the last)."""
        stream = self.chat(messages, **sampling) if messages is not None else self.generate(prompt, **sampling)
        return join([chunk async for chunk in stream])

    async def list_models(self, timeout: float | None = None, *,
                          metadata: Metadata | None = None) -> router_service_pb2.ListModelsResponse:
        deadline = time.monotonic() + (timeout or self._o.timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._stub.ListModels(router_service_pb2.ListModelsRequest(),
                                                   metadata=self._o.metadata(metadata), timeout=_left(deadline))
            except grpc.aio.AioRpcError as exc:
                await self._wait(attempt, exc, deadline)

    async def cached_tool_call(self, tool: str, arguments, compute, *, version: str = "1",
                               ttl_seconds: int = 0, lease_ms: int = 0,
                               timeout: float | None = None) -> ToolResult:
        """The result of `tool(arguments)` (arguments: a JSON-able value or JSON text) from the
        router's tool-result cache; on a miss `compute(arguments)` (sync or async, returning
        bytes or str) runs here once while concurrent callers of the tenant wait for it."""
        lookup = tool_lookup_request(tool, version, arguments, lease_ms)
        metadata, timeout = self._o.metadata(), timeout or self._o.timeout
        found = await self._stub.LookupToolResult(lookup, metadata=metadata, timeout=timeout)
        if found.outcome != _LEASE:
            return stored_result(found)
        store = router_service_pb2.StoreToolResultRequest(tool=tool, tool_version=version,
                                                   arguments_json=lookup.arguments_json,
                                                   lease_id=found.lease_id, ttl_seconds=ttl_seconds)
        try:
            value = compute(arguments)
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            store.error_message = f"{type(exc).__name__}: {exc}"
            await self._stub.StoreToolResult(store, metadata=metadata, timeout=timeout)
            raise
        store.value = as_bytes(value)
        await self._stub.StoreToolResult(store, metadata=metadata, timeout=timeout)
        return ToolResult(store.value, COMPUTED)

    async def _chunks(self, request, timeout: float | None) -> AsyncIterator[Chunk]:
        async with contextlib.aclosing(self._stream(request, timeout)) as responses:
            async for response in responses:
                yield to_chunk(response.chunk)

    async def _stream(self, request, timeout: float | None, metadata: Metadata | None = None
                      ) -> AsyncIterator[router_service_pb2.GenerateResponse]:
        deadline = time.monotonic() + (timeout or self._o.timeout)
        attempt = 0
        while True:
            attempt += 1
            started = False
            call = self._stub.Generate(request, metadata=self._o.metadata(metadata), timeout=_left(deadline))
            try:
                async for response in call:
                    started = True
                    yield response
                return
            except grpc.aio.AioRpcError as exc:
                if started:
                    raise
                await self._wait(attempt, exc, deadline)
            finally:
                call.cancel()

    async def _wait(self, attempt: int, error: grpc.aio.AioRpcError, deadline: float) -> None:
        delay = self._o.retry.delay(attempt, error)
        if delay is None or time.monotonic() + delay >= deadline:
            raise error
        if self._o.sleep is not None:
            self._o.sleep(delay)
        await asyncio.sleep(delay)


class Client:
    """Blocking client with the same methods; iterate the streams in the calling thread."""

    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None, *, ca_pem: bytes | None = None,
                 timeout: float = 300.0, retry: RetryPolicy = RetryPolicy(),
                 sleep: Callable[[float], object] | None = None) -> None:
        self._o = _Options(address, token, ca_pem, timeout, retry, sleep)
        if ca_pem is not None:
            self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca_pem))
        else:
            self._channel = grpc.insecure_channel(address)
        self._stub = router_service_pb2_grpc.RouterServiceStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: str, **sampling) -> Iterator[Chunk]:
        return self._chunks(build_request(prompt=prompt, **sampling), sampling.get("timeout"))

    def chat(self, messages: Iterable[Message], **sampling) -> Iterator[Chunk]:
        return self._chunks(build_request(messages=messages, **sampling), sampling.get("timeout"))

    def stream(self, request: router_service_pb2.GenerateRequest, *, metadata: Metadata | None = None,
               timeout: float | None = None) -> Iterator[router_service_pb2.GenerateResponse]:
        return self._stream(request, timeout, metadata)

    def complete(self, prompt: str | None = None, messages: Iterable[Message] | None = None,
                 **sampling) -> Chunk:
        stream = self.chat(messages, **sampling) if messages is not None else self.generate(prompt, **sampling)
        return join(list(stream))

    def list_models(self, timeout: float | None = None, *,
                    metadata: Metadata | None = None) -> router_service_pb2.ListModelsResponse:
        deadline = time.monotonic() + (timeout or self._o.timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._stub.ListModels(router_service_pb2.ListModelsRequest(),
                                             metadata=self._o.metadata(metadata), timeout=_left(deadline))
            except grpc.RpcError as exc:
                self._wait(attempt, exc, deadline)

    def cached_tool_call(self, tool: str, arguments, compute, *, version: str = "1",
                         ttl_seconds: int = 0, lease_ms: int = 0, timeout: float | None = None) -> ToolResult:
        """As AsyncClient.cached_tool_call; `compute` is a plain function."""
        lookup = tool_lookup_request(tool, version, arguments, lease_ms)
        metadata, timeout = self._o.metadata(), timeout or self._o.timeout
        found = self._stub.LookupToolResult(lookup, metadata=metadata, timeout=timeout)
        if found.outcome != _LEASE:
            return stored_result(found)
        store = router_service_pb2.StoreToolResultRequest(tool=tool, tool_version=version,
                                                   arguments_json=lookup.arguments_json,
                                                   lease_id=found.lease_id, ttl_seconds=ttl_seconds)
        try:
            value = compute(arguments)
        except Exception as exc:
            store.error_message = f"{type(exc).__name__}: {exc}"
            self._stub.StoreToolResult(store, metadata=metadata, timeout=timeout)
            raise
        store.value = as_bytes(value)
        self._stub.StoreToolResult(store, metadata=metadata, timeout=timeout)
        return ToolResult(store.value, COMPUTED)

    def _chunks(self, request, timeout: float | None) -> Iterator[Chunk]:
        with contextlib.closing(self._stream(request, timeout)) as responses:
            for response in responses:
                yield to_chunk(response.chunk)

    def _stream(self, request, timeout: float | None, metadata: Metadata | None = None
                ) -> Iterator[router_service_pb2.GenerateResponse]:
        deadline = time.monotonic() + (timeout or self._o.timeout)
        attempt = 0
        while True:
            attempt += 1
            started = False
            call = self._stub.Generate(request, metadata=self._o.metadata(metadata), timeout=_left(deadline))
            try:
                for response in call:
                    started = True
                    yield response
                return
            except grpc.RpcError as exc:
                if started:
                    raise
                self._wait(attempt, exc, deadline)
            finally:
                call.cancel()

    def _wait(self, attempt: int, error: grpc.RpcError, deadline: float) -> None:
        delay = self._o.retry.delay(attempt, error)
        if delay is None or time.monotonic() + delay >= deadline:
            raise error
        if self._o.sleep is not None:
            self._o.sleep(delay)
        time.sleep(delay)


# ---- requests and chunks ------------------------------------------------------
def build_request(prompt: str | None = None, messages: Iterable[Message] | None = None, *,
                  max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0,
                  seed: int | None = None, stop: Iterable[str] = (), model: str = "",
                  timeout: float | None = None) -> router_service_pb2.GenerateRequest:
    """The router request for a prompt or a conversation (`timeout` is the call's, not the request's)."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                         top_p=top_p, stop=list(stop))
    if seed is not None:
        sampling.seed, sampling.has_seed = seed, True
    request = router_service_pb2.GenerateRequest(sampling=sampling, model=model)
    if messages is not None:
        request.messages.extend(common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    else:
        request.prompt = prompt or ""
    return request


def to_chunk(chunk: common_pb2.GenerateChunk) -> Chunk:
    return Chunk(chunk.text, tuple(chunk.token_ids), _FINISH.get(chunk.finish_reason),
                 chunk.usage if chunk.HasField("usage") else None)


def join(chunks: list[Chunk]) -> Chunk:
    last = chunks[-1] if chunks else Chunk("", ())
    return Chunk("".join(c.text for c in chunks), tuple(t for c in chunks for t in c.token_ids),
                 last.finish_reason, last.usage)


def tool_lookup_request(tool: str, version: str, arguments, lease_ms: int = 0) -> router_service_pb2.LookupToolResultRequest:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return router_service_pb2.LookupToolResultRequest(tool=tool, tool_version=version, arguments_json=text,
                                               lease_ms=lease_ms)


def stored_result(found: router_service_pb2.LookupToolResultResponse) -> ToolResult:
    if found.is_error:
        raise ToolCallError(found.error_message)
    return ToolResult(found.value, _OUTCOME[found.outcome])


def as_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise TypeError(f"a tool result must be bytes or str, got {type(value).__name__}")


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


__all__ = ["AsyncClient", "Chunk", "Client", "NO_RETRIES", "RetryPolicy", "ToolCallError", "ToolResult", "build_request",
           "pushback_s"]
