"""The gRPC aio server tracing interceptor, closing a streaming handler inside its span.

OpenTelemetry's aio server interceptor iterates a streaming handler's response generator
inside its own generator. When the caller cancels or its deadline passes, grpc closes the
outermost generator (OpenTelemetry's): its `with span` exits and ends the server span at
once, and the handler's generator is left suspended, to be finalized later. The handler's
`finally` (the router records ERROR with the gRPC code there) then ran on an ended span —
"Tried calling set_status on an ended span", the request's server span left UNSET (about one
deadline-exceeded request in four under load). This subclass closes the handler's generator
before the span ends; the rest is OpenTelemetry's behaviour.

It also attaches no context across a `yield`. OpenTelemetry's version enters the caller's
remote context and the server span as current (`attach`) around the whole stream; when the
caller cancels while the stream waits at a `yield`, gRPC drops the generator and the asyncio
finaliser closes it later in another task's context, where `detach` fails: "Failed to detach
context" tracebacks in the log, one per cancelled stream. Here the span's context is attached
only while the handler runs one step (`__anext__`, and its `aclose`) and detached before the
response is handed to gRPC, so every detach runs in the context its attach did.
"""

from __future__ import annotations

from urllib.parse import unquote

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import _aio_server
from opentelemetry.instrumentation.grpc.version import __version__
from opentelemetry.propagate import extract


class ClosingAioServerInterceptor(_aio_server.OpenTelemetryAioServerInterceptor):
    def _intercept_aio_server_stream(self, behavior, handler_call_details):
        async def _stream_interceptor(request_or_iterator, context):
            parent = extract({md.key: md.value for md in context.invocation_metadata() or ()})
            span = self._tracer.start_span(name=handler_call_details.method, context=parent,
                                           kind=trace.SpanKind.SERVER,
                                           attributes=_attributes(handler_call_details, context))
            in_span = trace.set_span_in_context(span, parent)
            context = _aio_server._OpenTelemetryAioServicerContext(context, span)
            responses = behavior(request_or_iterator, context)
            try:
                while True:
                    token = otel_context.attach(in_span)
                    try:
                        response = await responses.__anext__()
                    except StopAsyncIteration:
                        return
                    finally:
                        otel_context.detach(token)
                    yield response  # nothing attached while gRPC holds the stream here
            except Exception as error:
                if type(error) is not Exception:  # bare Exception: a gRPC abort, recorded by the context
                    span.record_exception(error)
                raise
            finally:
                token = otel_context.attach(in_span)
                try:
                    aclose = getattr(responses, "aclose", None)
                    if aclose is not None:
                        await aclose()  # the handler's own finally runs while the span is open
                finally:
                    otel_context.detach(token)
                    span.end()

        return _stream_interceptor


def _attributes(handler_call_details, context) -> dict:
    """The server span's attributes, as OpenTelemetry's interceptor sets them."""
    attributes = {"rpc.system": "grpc", "rpc.grpc.status_code": grpc.StatusCode.OK.value[0]}
    if handler_call_details.method:
        service, method = handler_call_details.method.lstrip("/").split("/", 1)
        attributes.update({"rpc.method": method, "rpc.service": service})
    metadata = dict(context.invocation_metadata() or ())
    if "user-agent" in metadata:
        attributes["rpc.user_agent"] = metadata["user-agent"]
    peer = context.peer() or ""
    if not peer.startswith("unix:"):
        try:
            ip, port = peer.split(",")[0].split(":", 1)[1].rsplit(":", 1)
        except IndexError:
            return attributes
        ip = unquote(ip)
        attributes.update({"net.peer.ip": ip, "net.peer.port": port})
        if ip in ("[::1]", "127.0.0.1"):
            attributes["net.peer.name"] = "localhost"
    return attributes


def server_tracing_interceptor(tracer_provider, filter_=None) -> ClosingAioServerInterceptor:
    tracer = trace.get_tracer("opentelemetry.instrumentation.grpc", __version__, tracer_provider,
                              schema_url="https://opentelemetry.io/schemas/1.11.0")
    return ClosingAioServerInterceptor(tracer, filter_=filter_)
