"""The gRPC aio server tracing interceptor, closing a streaming handler inside its span.

OpenTelemetry's aio server interceptor iterates a streaming handler's response generator
inside its own generator. When the caller cancels or its deadline passes, grpc closes the
outermost generator (OpenTelemetry's): its `with span` exits and ends the server span at
once, and the handler's generator is left suspended, to be finalized later. The handler's
`finally` (the router records ERROR with the gRPC code there) then ran on an ended span —
"Tried calling set_status on an ended span", the request's server span left UNSET (about one
deadline-exceeded request in four under load). This subclass closes the handler's generator
before the span ends; the rest is OpenTelemetry's behaviour.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.instrumentation.grpc import _aio_server
from opentelemetry.instrumentation.grpc.version import __version__


class ClosingAioServerInterceptor(_aio_server.OpenTelemetryAioServerInterceptor):
    def _intercept_aio_server_stream(self, behavior, handler_call_details):
        async def _stream_interceptor(request_or_iterator, context):
            with self._set_remote_context(context):
                with self._start_span(handler_call_details, context,
                                      set_status_on_exception=False) as span:
                    context = _aio_server._OpenTelemetryAioServicerContext(context, span)
                    responses = behavior(request_or_iterator, context)
                    try:
                        async for response in responses:
                            yield response
                    except Exception as error:
                        if type(error) is not Exception:  # bare Exception: a gRPC abort, recorded by the context
                            span.record_exception(error)
                        raise
                    finally:
                        aclose = getattr(responses, "aclose", None)
                        if aclose is not None:
                            await aclose()  # the handler's own finally runs while the span is open

        return _stream_interceptor


def server_tracing_interceptor(tracer_provider, filter_=None) -> ClosingAioServerInterceptor:
    tracer = trace.get_tracer("opentelemetry.instrumentation.grpc", __version__, tracer_provider,
                              schema_url="https://opentelemetry.io/schemas/1.11.0")
    return ClosingAioServerInterceptor(tracer, filter_=filter_)
