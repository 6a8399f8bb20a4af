from __future__ import annotations

import os

# Triton runs under its interpreter on the CPU. @triton.jit picks interpreted or compiled kernels
# when a kernel module is imported, and any test module (not only tests/kernels/) may import
# one during collection, so the variable is set here, before every test module.
# benchmarks/gpu_kernels.py runs the kernel tests on CUDA with TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from services.common.telemetry import TelemetryConfig, setup_telemetry  # noqa: E402

_SPANS = InMemorySpanExporter()
# Each service reports its own service.name; metrics are read by scraping /metrics (tests/e2e/test_metrics.py).
setup_telemetry(TelemetryConfig("specmesh-tests-{service}"), span_exporter=_SPANS)


@pytest.fixture
def spans() -> InMemorySpanExporter:
    _SPANS.clear()
    return _SPANS


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from services.common.models.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory):
    from services.common.models.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gemma"), arch="gemma3", seed=1)
