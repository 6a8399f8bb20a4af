"""A server interceptor that records `rpc.server.call.duration` for every RPC of a service,
by method and final status code, so every service (the cache included) exports request
counts by status without code in each handler, and marks the call's server span ERROR with
the gRPC code when it fails, is cancelled or runs past its deadline. Health and reflection
are skipped."""

from __future__ import annotations

import asyncio
import time

import grpc
from opentelemetry import trace

from services.common.instruments import histogram
from services.common.metrics import RPC_DURATION
from services.common.telemetry import record_error

_SKIPPED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, service: str) -> None:
        self.service = service

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_SKIPPED_PREFIXES):
            return handler
        record = _recorder(histogram(self.service, RPC_DURATION), method)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, record), handler.request_deserializer,
                handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _unary(handler.stream_unary, record), handler.request_deserializer,
                handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _stream(handler.unary_stream, record), handler.request_deserializer,
                handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            _stream(handler.stream_stream, record), handler.request_deserializer,
            handler.response_serializer)


def _recorder(instrument, method: str):
    def record(start: float, context, error: BaseException | None) -> None:
        status = status_of(context, error)
        instrument.record(time.monotonic() - start, {"rpc.method": method, "rpc.grpc.status_code": status})
        if status != "OK":  # the server span (tracing interceptor) says why the call failed
            record_error(trace.get_current_span(), status)
    return record


def status_of(context, error: BaseException | None) -> str:
    """The call's final status name: OK, the aborted code, DEADLINE_EXCEEDED or CANCELLED
    (the caller went away), or UNKNOWN."""
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        remaining = _time_remaining(context)
        # grpc's deadline timer can fire a few ms before this clock reaches the deadline
        # (seen under load: a deadline-exceeded call read as CANCELLED with time left > 0).
        return ("DEADLINE_EXCEEDED" if remaining is not None and remaining <= _DEADLINE_SLACK_S
                else "CANCELLED")
    code = None
    try:
        code = context.code()
    except (AttributeError, NotImplementedError, RuntimeError):
        # Not every context can tell: grpc's generic-handler contexts have no code(), and some
        # raise once the call has ended. The status then follows from the error alone.
        pass
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        return _name_of(code)
    return "OK" if error is None else "UNKNOWN"


_DEADLINE_SLACK_S = 0.02


def _time_remaining(context) -> float | None:
    try:
        return context.time_remaining()
    except Exception:
        return None


def _name_of(value: int) -> str:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code.name
    return "UNKNOWN"


def _unary(behavior, record):
    async def wrapper(request, context):
        start, error = time.monotonic(), None
        try:
            return await behavior(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            record(start, context, error)
    return wrapper


def _stream(behavior, record):
    async def wrapper(request, context):
        start, error = time.monotonic(), None
        try:
            async for response in behavior(request, context):
                yield response
        except BaseException as exc:
            error = exc
            raise
        finally:
            record(start, context, error)
    return wrapper
