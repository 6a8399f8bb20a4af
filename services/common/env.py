"""The one place that reads the environment. Everything else takes config dataclasses.

Every setting has an environment variable (SPECMESH_*) and a CLI flag; flags win.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_PORTS = {"router": 50051, "target": 50052, "draft": 50053, "cache": 50054}
DEV_TOKEN = "specmesh-dev-token"  # what `specmesh up` accepts unless SPECMESH_TOKENS is set


@dataclass
class Settings:
    """Raw settings for all services; each service builds its validated config from these."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 = the service's default port
    model: str = "default"  # "default" (Gemma 3 270M) or a local Hugging Face directory
    model_cache: str = str(Path.home() / ".cache" / "specmesh" / "models")
    dtype: str = "bfloat16"
    kv_dtype: str = "auto"
    kernels: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 2048
    max_num_seqs: int = 32
    max_batched_tokens: int = 512
    max_queued_requests: int = 256
    max_tokens_limit: int = 4096
    router_address: str = f"127.0.0.1:{DEFAULT_PORTS['router']}"
    target_address: str = f"127.0.0.1:{DEFAULT_PORTS['target']}"
    draft_address: str = f"127.0.0.1:{DEFAULT_PORTS['draft']}"
    cache_address: str = f"127.0.0.1:{DEFAULT_PORTS['cache']}"
    tokens: str = f"{DEV_TOKEN}=default"  # TOKEN=TENANT,... accepted by the router
    token: str = DEV_TOKEN  # what the `generate` client sends
    salt_secret: str = "specmesh-dev-secret"
    cache_backend: str = "memory"
    redis_url: str = ""
    otlp_endpoint: str = ""  # OTEL_EXPORTER_OTLP_ENDPOINT
    grace_seconds: float = 10.0
    speculation_method: str = "prompt_lookup"  # off | prompt_lookup | suffix | draft_model | dynamic_tree
    speculation_depth: int = 5
    speculation_nodes: int = 0  # tree node budget; 0 = a chain
    speculation_policy: str = "fixed"  # fixed | adaptive (depth per bucket from measured acceptance)
    draft_model: str = ""  # local HF causal LM directory for the draft service (draft_model / dynamic_tree)
    draft_timeout_ms: int = 500  # per-step deadline of the target's draft call


def read_settings(environ: dict[str, str] | None = None, **overrides) -> Settings:
    """Defaults, then SPECMESH_<NAME> variables, then explicit overrides (CLI flags, not None)."""
    environ = os.environ if environ is None else environ
    settings = Settings()
    for f in fields(Settings):
        raw = environ.get(f"SPECMESH_{f.name.upper()}")
        if f.name == "otlp_endpoint" and raw is None:
            raw = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if raw is not None:
            setattr(settings, f.name, _convert(f.name, raw, type(getattr(settings, f.name))))
    for name, value in overrides.items():
        if value is not None:
            setattr(settings, name, value)
    return settings


def _convert(name: str, raw: str, kind: type):
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"environment variable SPECMESH_{name.upper()}={raw!r} is not a valid "
                         f"{kind.__name__}") from None
