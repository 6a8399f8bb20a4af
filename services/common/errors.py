"""Errors with the rich gRPC error model, and requests that fail to parse.

Every refusal of the router and the target goes through `abort`: the status code and
message as before, plus a `google.rpc.Status` in the `grpc-status-details-bin` trailer
(via grpcio-status) with
- `ErrorInfo`: a stable machine-readable `reason` (e.g. REQUEST_TOO_LARGE) and domain,
- `BadRequest`: one field violation per invalid field (INVALID_ARGUMENT),
- `RetryInfo`: when to retry (RESOURCE_EXHAUSTED / UNAVAILABLE).
Clients read them back with `details_of(rpc_error)`.

`guard_malformed(server)` makes a server answer a request that does not parse (invalid
UTF-8 in a string field, truncated bytes) with INVALID_ARGUMENT instead of gRPC's
generic failure: use it in place of the server when adding a generated servicer.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "specmesh.dev"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class Violation:
    """One invalid field of a request: its path (e.g. "sampling.top_p") and what is wrong."""

    field: str
    description: str


class Refusal(Exception):
    """A refusal raised below the servicer; the servicer turns it into `abort(...)`."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str,
                 violations: Iterable[Violation] = (), retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.reason = code, message, reason
        self.violations, self.retry_after_s = tuple(violations), retry_after_s


def rich_status(code: grpc.StatusCode, message: str, reason: str,
                violations: Iterable[Violation] = (), retry_after_s: float | None = None,
                metadata: dict[str, str] | None = None) -> grpc.Status:
    """A grpc.Status carrying ErrorInfo, and BadRequest / RetryInfo when given."""
    details = [error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata or {})]
    violations = list(violations)
    if violations:
        details.append(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in violations]))
    if retry_after_s is not None:
        seconds = int(retry_after_s)
        details.append(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
            seconds=seconds, nanos=int((retry_after_s - seconds) * 1e9))))
    status = status_pb2.Status(code=code.value[0], message=message)
    for detail in details:
        status.details.add().Pack(detail)
    return rpc_status.to_status(status)


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, reason: str,
                violations: Iterable[Violation] = (), retry_after_s: float | None = None) -> None:
    """Ends the call with `code` and the rich details (never returns).

    RetryInfo also goes out as gRPC's own `grpc-retry-pushback-ms` trailer, which
    clients with a retry policy honour.
    """
    status = rich_status(code, message, reason, violations, retry_after_s)
    trailers = tuple(status.trailing_metadata)
    if retry_after_s is not None:
        trailers += ((RETRY_PUSHBACK_KEY, str(int(retry_after_s * 1000))),)
    await context.abort(code, message, trailers)


async def abort_refusal(context: grpc.aio.ServicerContext, refusal: Refusal) -> None:
    await abort(context, refusal.code, refusal.message, refusal.reason, refusal.violations,
                refusal.retry_after_s)


def relay_trailers(trailers, code: grpc.StatusCode, message: str) -> tuple:
    """A dependency's trailers for our own status (`code`, `message`): the retry pushback as
    is, the rich details re-stamped with our message (clients check that they agree), and
    dropped when we answer with another code than the dependency did."""
    out = []
    for key, value in trailers or ():
        if key == RETRY_PUSHBACK_KEY:
            out.append((key, value))
        elif key == DETAILS_KEY:
            status = status_pb2.Status.FromString(value)
            if status.code == code.value[0]:
                status.message = message
                out.append((key, status.SerializeToString()))
    return tuple(out)


def details_of(error: grpc.RpcError) -> dict[str, Message]:
    """The rich details of a failed call by kind: {"ErrorInfo": ..., "BadRequest": ..., ...}."""
    status = rpc_status.from_call(error)  # also checks that code and message agree
    out: dict[str, Message] = {}
    for any_ in status.details if status is not None else ():
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            if any_.Is(cls.DESCRIPTOR):
                message = cls()
                any_.Unpack(message)
                out[cls.DESCRIPTOR.name] = message
    return out


# ---- requests that do not parse -------------------------------------------
@dataclass(frozen=True)
class Malformed:
    """Stands in for a request message whose bytes did not parse."""

    error: str


def guard_malformed(server: grpc.aio.Server) -> "_GuardedServer":
    """Wraps `server` for a generated `add_*Servicer_to_server`: requests that fail to parse
    get INVALID_ARGUMENT (reason MALFORMED_REQUEST) before the servicer sees them."""
    return _GuardedServer(server)


class _GuardedServer:
    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(service, {k: _guard(v) for k, v in handlers.items()})

    def __getattr__(self, name):
        return getattr(self._server, name)


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, handler: grpc.GenericRpcHandler) -> None:
        self._handler = handler

    def service(self, handler_call_details):
        handler = self._handler.service(handler_call_details)
        return None if handler is None else _guard(handler)

    def __getattr__(self, name):  # e.g. service_name() of method_handlers_generic_handler
        return getattr(self._handler, name)


def _guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    if parse is None or handler.request_streaming:
        return handler

    def safe_parse(data: bytes):
        try:
            return parse(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return Malformed(f"{type(exc).__name__}: {exc}")
    if handler.unary_stream is not None:
        behaviour = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, Malformed):
                await _refuse_malformed(context, request)
            result = behaviour(request, context)
            if inspect.isasyncgen(result):
                async for response in result:
                    yield response
            else:  # a coroutine or sync iterator
                for response in (await result if inspect.isawaitable(result) else result):
                    yield response
        return handler._replace(request_deserializer=safe_parse, unary_stream=unary_stream)
    behaviour = handler.unary_unary

    async def unary_unary(request, context):
        if isinstance(request, Malformed):
            await _refuse_malformed(context, request)
        result = behaviour(request, context)
        return await result if inspect.isawaitable(result) else result
    return handler._replace(request_deserializer=safe_parse, unary_unary=unary_unary)


async def _refuse_malformed(context, request: Malformed) -> None:
    await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                "request does not parse (string fields must be valid UTF-8)", "MALFORMED_REQUEST",
                [Violation("request", request.error)])
