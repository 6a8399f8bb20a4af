"""OpenTelemetry setup shared by all services: tracer and meter providers, gRPC interceptors.

A process sets up its providers once (OpenTelemetry allows one global provider);
`specmesh up` runs several services in one process and they share it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.grpc import (
    aio_client_interceptors,
    aio_server_interceptor,
    filters,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)

_lock = threading.Lock()
_configured = False

# Health checks and reflection are polled constantly; tracing them is noise.
_TRACE_FILTER = filters.negate(filters.any_of(
    filters.health_check(),
    filters.service_prefix("grpc.reflection"),
))


@dataclass(frozen=True)
class TelemetryConfig:
    """Where traces and metrics go. Validated on construction."""

    service_name: str = "specmesh"
    otlp_endpoint: str | None = None  # e.g. "http://otel-collector:4317"; None = no export

    def __post_init__(self) -> None:
        if not self.service_name:
            raise ValueError("TelemetryConfig.service_name must not be empty")


def setup_telemetry(config: TelemetryConfig, span_exporter: SpanExporter | None = None,
                    metric_reader: MetricReader | None = None) -> None:
    """Installs the global tracer and meter providers once per process.

    `span_exporter` / `metric_reader` let tests read spans and metrics in memory.
    Later calls are ignored, except that they may add a span exporter.
    """
    global _configured
    with _lock:
        provider = trace.get_tracer_provider()
        if not _configured:
            resource = Resource.create({"service.name": config.service_name})
            provider = TracerProvider(resource=resource)
            readers = [metric_reader] if metric_reader is not None else []
            if config.otlp_endpoint:
                provider.add_span_processor(BatchSpanProcessor(_otlp_span_exporter(config.otlp_endpoint)))
                readers.append(_otlp_metric_reader(config.otlp_endpoint))
            trace.set_tracer_provider(provider)
            metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
            _configured = True
        if span_exporter is not None and isinstance(provider, TracerProvider):
            provider.add_span_processor(SimpleSpanProcessor(span_exporter))


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [aio_server_interceptor(filter_=_TRACE_FILTER)]


def client_interceptors() -> list:
    return list(aio_client_interceptors(filter_=_TRACE_FILTER))


def _otlp_span_exporter(endpoint: str) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=endpoint, insecure=True)


def _otlp_metric_reader(endpoint: str) -> MetricReader:
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
        OTLPMetricExporter,
    )
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    return PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint, insecure=True))
