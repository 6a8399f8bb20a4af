"""OpenTelemetry setup shared by all services: per-service tracer and meter providers,
Prometheus `/metrics` endpoints, gRPC interceptors.

Each service (router, target, draft, cache) gets its own providers with its own
`service.name`, even when `specmesh up` runs all four in one process:
- `tracer(service)` / `meter(service)` give that service's tracer and meter;
- the global tracer provider routes a span to the provider of its parent span, so
  code that calls `trace.get_tracer(...)` inside a service's request (and the gRPC
  client interceptor) lands in that service without naming it;
- every service's meter provider has its own Prometheus registry, served by
  `serve_metrics(service, host, port)`; OTLP export is added when an endpoint is set.

A process calls `setup_telemetry` once, before the first span or metric.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.instrumentation.grpc import aio_client_interceptors, filters
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.util._decorator import _agnosticcontextmanager

from services.common.metrics import VIEWS
from services.common.trace_interceptor import server_tracing_interceptor

SERVICES = ("router", "target", "draft", "cache")
PROCESS = "process"  # spans and metrics outside any service's work
_FILTERED_RPCS = (
    # Long-lived internal streams and per-sequence housekeeping: their work shows up in
    # the requests' own spans; tracing the calls would make one trace per stream or per
    # finished sequence (orphans next to the request's trace).
    "/specmesh.v1.DraftService/ProposeStream",
    "/specmesh.v1.DraftService/Release",
    "/specmesh.v1.TargetService/SubscribeKVEvents",
    "/specmesh.v1.TargetService/GetStats",  # the router polls every replica each second
)
# Health checks and reflection are polled constantly; tracing them is noise.
_TRACE_FILTER = filters.negate(filters.any_of(
    filters.health_check(),
    filters.service_prefix("grpc.reflection"),
    *(filters.full_method_name(name) for name in _FILTERED_RPCS),
))


@dataclass(frozen=True)
class TelemetryConfig:
    """Where traces and metrics go. Validated on construction.

    `service_name` names each service's resource; "{service}" in it is replaced by
    router / target / draft / cache (OTEL_SERVICE_NAME, when set, arrives here).
    """

    service_name: str = "specmesh-{service}"
    otlp_endpoint: str | None = None  # e.g. "http://otel-collector:4317"; None = no export
    otlp_metric_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.service_name:
            raise ValueError("TelemetryConfig.service_name must not be empty")
        if self.otlp_metric_interval_s <= 0:
            raise ValueError("otlp_metric_interval_s must be > 0")

    def name_for(self, service: str) -> str:
        return self.service_name.replace("{service}", service)


def setup_telemetry(config: TelemetryConfig, span_exporter: SpanExporter | None = None) -> None:
    """Installs the configuration once per process (later calls may only add an exporter).

    `span_exporter` (tests) receives every service's finished spans synchronously.
    """
    with _lock:
        if _state.config is None:
            _state.config = config
            if config.otlp_endpoint:
                _state.fanout.add(BatchSpanProcessor(_otlp_span_exporter(config.otlp_endpoint)))
            trace.set_tracer_provider(_RoutingTracerProvider())
            metrics.set_meter_provider(_provider_pair(PROCESS)[1])
    if span_exporter is not None:
        add_span_exporter(span_exporter)


def add_span_exporter(exporter: SpanExporter, batch: bool = False) -> SpanProcessor:
    """Sends every service's finished spans to `exporter` (synchronously, or batched on a
    background thread); returns a handle for `remove_span_processor`."""
    processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
    _state.fanout.add(processor)
    return processor


def remove_span_processor(processor: SpanProcessor) -> None:
    """Exports what the processor holds, then stops sending it spans."""
    processor.force_flush()
    _state.fanout.remove(processor)
    processor.shutdown()


def record_error(span: trace.Span, code: str, description: str = "") -> None:
    """ERROR status with the gRPC status code (`code`: a grpc.StatusCode name) on `span`."""
    span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[code].value[0])
    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code}: {description}" if description else code))


def tracer(service: str, scope: str | None = None) -> trace.Tracer:
    return _provider_pair(service)[0].get_tracer(scope or f"specmesh.{service}")


def meter(service: str, scope: str | None = None) -> metrics.Meter:
    return _provider_pair(service)[1].get_meter(scope or f"specmesh.{service}")


def serve_metrics(service: str, host: str, port: int) -> int:
    """Serves the service's Prometheus `/metrics` on host:port (0 = any free port).

    Returns the bound port. Idempotent per service: a second call returns the first port.
    """
    from prometheus_client import start_http_server
    _provider_pair(service)
    with _lock:
        if service in _state.metrics_ports:
            return _state.metrics_ports[service]
        server, _ = start_http_server(port, addr=host, registry=_state.registries[service])
        _state.metrics_ports[service] = server.server_port
        _state.http_servers.append(server)
        return server.server_port


def service_of(grpc_service_names: Sequence[str]) -> str:
    """'target' for ["specmesh.v1.TargetService"], PROCESS when none matches."""
    for full in grpc_service_names:
        short = full.rsplit(".", 1)[-1].removesuffix("Service").lower()
        if short in SERVICES:
            return short
    return PROCESS


def server_interceptors(service: str = PROCESS) -> list[grpc.aio.ServerInterceptor]:
    provider = _provider_pair(service)[0]
    return [server_tracing_interceptor(provider, filter_=_TRACE_FILTER)]


def client_interceptors() -> list:
    """Client spans go to the provider of the calling service's current span."""
    return list(aio_client_interceptors(filter_=_TRACE_FILTER))


# ---- helpers ----------------------------------------------------------------
class _Fanout(SpanProcessor):
    """One processor list shared by every service's tracer provider; exporters can be
    added (and removed, in tests) after the providers exist."""

    def __init__(self) -> None:
        self._processors: tuple[SpanProcessor, ...] = ()
        self._lock = threading.Lock()

    def add(self, processor: SpanProcessor) -> None:
        with self._lock:
            self._processors = (*self._processors, processor)

    def remove(self, processor: SpanProcessor) -> None:
        with self._lock:
            self._processors = tuple(p for p in self._processors if p is not processor)

    def on_start(self, span, parent_context: Context | None = None) -> None:
        for p in self._processors:
            p.on_start(span, parent_context=parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        for p in self._processors:
            p.on_end(span)

    def shutdown(self) -> None:
        for p in self._processors:
            p.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(p.force_flush(timeout_millis) for p in self._processors)


class _State:
    def __init__(self) -> None:
        self.config: TelemetryConfig | None = None
        self.fanout = _Fanout()
        self.providers: dict[str, tuple[TracerProvider, MeterProvider]] = {}
        self.registries: dict = {}
        self.metrics_ports: dict[str, int] = {}
        self.http_servers: list = []
        self.by_resource: dict[int, TracerProvider] = {}


_lock = threading.RLock()
_state = _State()


def _provider_pair(service: str) -> tuple[TracerProvider, MeterProvider]:
    pair = _state.providers.get(service)
    if pair is not None:
        return pair
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry

    with _lock:
        if service in _state.providers:
            return _state.providers[service]
        config = _state.config or TelemetryConfig()
        name = config.name_for(service)
        if service == PROCESS:  # "specmesh-{service}" -> "specmesh"
            name = config.service_name.replace("-{service}", "").replace("{service}", "specmesh")
        resource = Resource.create({"service.name": name})
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(_state.fanout)
        registry = CollectorRegistry(auto_describe=True)
        readers: list[MetricReader] = [PrometheusMetricReader(registry=registry)]
        if config.otlp_endpoint:
            readers.append(_otlp_metric_reader(config.otlp_endpoint, config.otlp_metric_interval_s))
        meter_provider = MeterProvider(resource=resource, metric_readers=readers, views=VIEWS)
        _state.registries[service] = registry
        _state.by_resource[id(tracer_provider.resource)] = tracer_provider
        _state.providers[service] = (tracer_provider, meter_provider)
        return _state.providers[service]


class _RoutingTracerProvider(trace.TracerProvider):
    """The global provider: a span goes to its parent span's service (PROCESS when none)."""

    def get_tracer(self, instrumenting_module_name, instrumenting_library_version=None,
                   schema_url=None, attributes=None):
        return _RoutingTracer(instrumenting_module_name, instrumenting_library_version, schema_url)


class _RoutingTracer(trace.Tracer):
    def __init__(self, name: str, version: str | None, schema_url: str | None) -> None:
        self._args = (name, version, schema_url)

    def start_span(self, name, context=None, *args, **kwargs):
        return self._pick(context).start_span(name, context, *args, **kwargs)

    @_agnosticcontextmanager
    def start_as_current_span(self, name, context=None, *args, **kwargs):
        with self._pick(context).start_as_current_span(name, context, *args, **kwargs) as span:
            yield span

    def _pick(self, context) -> trace.Tracer:
        parent = trace.get_current_span(context)
        resource = getattr(parent, "resource", None)
        provider = _state.by_resource.get(id(resource)) if resource is not None else None
        if provider is None:
            provider = _provider_pair(PROCESS)[0]
        return provider.get_tracer(*self._args)


def _otlp_span_exporter(endpoint: str) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint, insecure=True)


def _otlp_metric_reader(endpoint: str, interval_s: float) -> MetricReader:
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
        OTLPMetricExporter,
    )
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    return PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, insecure=True),
                                         export_interval_millis=interval_s * 1000)
