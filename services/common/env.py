"""The one place that reads settings: every setting is declared once, in `Settings` below.

Each field carries its type, default, allowed values (Literal or constraints) and help text
(`description`). The same declaration yields the CLI flag (`--num-blocks`, generated in
services/cli.py), the environment variable (`SPECMESH_NUM_BLOCKS`) and the key under
`settings:` in the mesh config file (YAML, given by `--config` or `SPECMESH_CONFIG`; other
top-level keys of that file, such as `pools:`, belong to their own readers).

Precedence: flags > SPECMESH_* environment > config file > defaults. A value that does not
fit its declaration raises ValueError naming the setting, where it came from and what is
allowed. To add a setting, add one field here (`name: type = Field(default, description=...)`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.speculation_plan import (
    MAX_DEPTH,
    MAX_NODES,
    SpeculationMethodName,
    SpeculationPolicyMode,
)

DEFAULT_PORTS = {"router": 50051, "target": 50052, "draft": 50053, "cache": 50054, "gateway": 8000}
DEV_TOKEN = "specmesh-dev-token"  # what `specmesh up` accepts unless SPECMESH_TOKENS is set
DEV_SALT_SECRET = "specmesh-dev-secret"  # public: `serve router` refuses it unless --dev
ENV_PREFIX = "SPECMESH_"
# Read when SPECMESH_<NAME> is unset.
_ENV_ALIASES = {"otlp_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT", "service_name": "OTEL_SERVICE_NAME"}


class Settings(BaseModel):
    """Settings for all services; each service builds its validated config from these
    (services/builders.py)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    config: str = Field("", description="mesh config file (YAML); its `settings:` mapping sets any "
                        "setting below (flags and SPECMESH_* variables win)")
    host: str = Field("127.0.0.1", description="interface the services listen on")
    port: int = Field(0, ge=0, le=65535, description="listening port; 0 = the service's default "
                      "(for `up`: the router's port, target/draft/cache take the next three)")
    gateway_port: int = Field(DEFAULT_PORTS["gateway"], ge=0, le=65535,
                              description="OpenAI-compatible HTTP gateway port (`serve gateway`; "
                              "for `up`: 0 = no gateway)")
    model: str = Field("default", description="target model: 'default' (Gemma 3 270M) or a local "
                       "Hugging Face model directory")
    chat_template: str = Field("", description="chat template of the target model: a Jinja file (or a "
                               "JSON file with \"chat_template\"), a name (gemma3, or none = plain prompts only), "
                               "or empty = the model's own, Gemma 3's for a model without one that has Gemma's "
                               "turn tokens (the default model)")
    model_cache: str = Field(str(Path.home() / ".cache" / "specmesh" / "models"),
                             description="where prepared models are cached")
    dtype: Literal["bfloat16", "float32", "float16"] = Field(
        "bfloat16", description="weight and activation dtype of the target (and draft LM)")
    kv_dtype: Literal["auto", "bfloat16", "float32", "float16", "fp8"] = Field(
        "auto", description="KV cache dtype; auto = same as dtype (float32 on the CPU, where "
        "attention computes in float32), fp8 = float8 with scales")
    kernels: Literal["auto", "triton", "cpu", "reference"] = Field(
        "auto", description="attention kernels; auto = Triton where CUDA is present, else cpu")
    weights: Literal["auto", "none", "bf16", "bf16-avx512", "fp16", "int8"] = Field(
        "auto", description="linear-layer weights; auto = specmesh's AVX-512 kernel (bf16-avx512) for a "
        "bf16 model on an AVX-512 CPU, else oneDNN-packed bf16 on a CPU with bf16 dot products in "
        "hardware, else fp16 packed for fbgemm when a bf16/fp16 model runs on the CPU; "
        "int8 = per-channel int8 (fbgemm dynamic quantization)")
    device: str = Field("cpu", description="torch device of the target (cpu, cuda, cuda:N)")
    block_size: int = Field(16, gt=0, description="tokens per KV block")
    num_blocks: int = Field(2048, gt=0, description="KV blocks in the target's pool")
    kv_host_bytes: int = Field(1 << 30, ge=0, description="host tier below the target's KV pool: bytes of "
                               "evicted prefix blocks kept in host memory and restored instead of "
                               "recomputed; 0 = none")
    max_num_seqs: int = Field(32, gt=0, description="sequences the target runs at once")
    max_batched_tokens: int = Field(512, gt=0, description="tokens per engine step "
                                    "(prefill chunks + decodes + verify trees)")
    max_queued_requests: int = Field(256, ge=0, description="requests waiting beyond max_num_seqs; "
                                     "more are refused with RESOURCE_EXHAUSTED")
    max_queued_tokens: int = Field(262144, gt=0, description="prompt tokens waiting for admission at the "
                                   "target; more are refused with RESOURCE_EXHAUSTED")
    max_tokens_limit: int = Field(4096, gt=0, description="largest max_tokens a request may ask for")
    max_samples: int = Field(16, gt=0, le=128, description="largest n (samples of one prompt, sharing "
                             "one prefill) a request may ask for; the target also caps it at max_num_seqs")
    max_prompt_bytes: int = Field(1 << 20, gt=0, description="largest prompt (or sum of chat message "
                                  "contents) in UTF-8 bytes; router and target refuse more before tokenizing")
    max_stop_sequences: int = Field(16, gt=0, description="most stop sequences a request may give")
    max_stop_bytes: int = Field(256, gt=0, description="longest stop sequence in UTF-8 bytes")
    router_address: str = Field(f"127.0.0.1:{DEFAULT_PORTS['router']}",
                                description="router address (host:port) the clients and gateway call")
    target_address: str = Field(f"127.0.0.1:{DEFAULT_PORTS['target']}",
                                description="target address the router calls")
    draft_address: str = Field(f"127.0.0.1:{DEFAULT_PORTS['draft']}",
                               description="draft service address the target calls")
    cache_address: str = Field(f"127.0.0.1:{DEFAULT_PORTS['cache']}",
                               description="cache service address")
    tokens: str = Field(f"{DEV_TOKEN}=default",
                        description="bearer tokens the router accepts: TOKEN=TENANT,...")
    token: str = Field(DEV_TOKEN, description="bearer token the `generate`/`status` clients send")
    salt_secret: str = Field(DEV_SALT_SECRET,
                             description="secret the router derives per-tenant prefix-cache salts from")
    cache_backend: Literal["memory", "redis"] = Field(
        "memory", description="cache service store: memory (one process) or redis (shared)")
    redis_url: str = Field("", description="Redis URL for cache_backend redis (redis://host:port/db)")
    cache_replicas: str = Field("", description="target addresses (comma-separated) whose KV events the "
                                "cache's prefix index follows; '' = the mesh config's pool replicas, "
                                "else target_address")
    cache_max_memory_mb: int = Field(256, gt=0, description="memory cache backend: size bound of cached "
                                     "results before least-recently-used eviction")
    retrieval_mode: Literal["bm25", "dense", "hybrid"] = Field(
        "bm25", description="cache service retrieval scoring; dense and hybrid (rank fusion with BM25) "
        "need the `dense` extra (offline all-MiniLM-L6-v2) or embedding_model")
    embedding_model: str = Field("", description="dense / hybrid retrieval: local sentence-embedding "
                                 "model directory; '' = the `dense` extra's all-MiniLM-L6-v2")
    otlp_endpoint: str = Field("", description="OpenTelemetry OTLP gRPC endpoint; '' = no export "
                               "(also read from OTEL_EXPORTER_OTLP_ENDPOINT)")
    service_name: str = Field("", description="OpenTelemetry service.name; '' = specmesh-SERVICE "
                              "(also read from OTEL_SERVICE_NAME; `up` appends -SERVICE)")
    metrics_port: int = Field(9464, ge=0, le=65535, description="`serve`: port of the Prometheus "
                              "/metrics endpoint; 0 = none")
    metrics_base_port: int = Field(9464, ge=0, le=65535, description="`up`: router, target, draft and "
                                   "cache serve Prometheus /metrics on this port and the next three; 0 = none")
    grace_seconds: float = Field(10.0, ge=0, description="graceful-shutdown drain time on SIGTERM")
    speculation_method: SpeculationMethodName = Field(
        "prompt_lookup", description="speculative decoding method the router plans (requests with a "
        "constraint get grammar drafts unless 'off'; 'grammar' = only they speculate)")
    speculation_depth: int = Field(5, gt=0, le=MAX_DEPTH, description="draft tokens per verify pass (chain depth)")
    speculation_nodes: int = Field(0, ge=0, le=MAX_NODES, description="draft tree node budget; 0 = a chain")
    speculation_policy: SpeculationPolicyMode = Field(
        "adaptive", description="adaptive depth per bucket and per step from predicted and measured "
        "acceptance, load and step times (docs/p99_incident.md), or the fixed plan for every request")
    replicas: int = Field(1, ge=1, le=16, description="`up`: target replicas of the default pool on "
                          "loopback (the first on the target port, more after the cache port)")
    replica_policy: Literal["kv_aware", "least_loaded", "round_robin"] = Field(
        "kv_aware", description="router's replica choice in a pool: longest cached prefix (cache "
        "service's prefix index) against load, least loaded, or in turn")
    replica_poll_seconds: float = Field(1.0, gt=0, le=60, description="router's health and stats "
                                        "poll of every replica (ejection and rejoin)")
    draft_model: str = Field("", description="draft LM for draft_model / dynamic_tree: 'default' "
                             "or a local Hugging Face directory")
    draft_timeout_ms: int = Field(500, gt=0, le=60000,
                                  description="per-step deadline of the target's draft call (ms)")
    fault_injection: bool = Field(False, description="testing only: SIGUSR1 makes the target's engine "
                                  "loop fail once outside a step (exercises its supervision and restart)")
    dev: bool = Field(False, description="development mode: plaintext between services when no mesh "
                      "certificates are given, and the public default salt_secret is accepted")
    tls_dir: str = Field("", description="mesh certificates from `specmesh certs` (ca.pem, SERVICE.pem, "
                         "SERVICE-key.pem): internal calls use mutual TLS; '' = none (needs --dev)")
    tls_ca: str = Field("", description="mesh CA certificate (PEM); '' = tls_dir/ca.pem")
    tls_cert: str = Field("", description="this service's mesh certificate (PEM); '' = tls_dir/SERVICE.pem")
    tls_key: str = Field("", description="this service's mesh private key (PEM); '' = tls_dir/SERVICE-key.pem")
    public_tls_cert: str = Field("", description="certificate chain (PEM) for TLS on the router's public "
                                 "port; '' = plaintext")
    public_tls_key: str = Field("", description="private key (PEM) for TLS on the router's public port")
    router_ca: str = Field("", description="CA certificate (PEM) the clients verify the router's public "
                           "TLS with; '' = plaintext")


def read_settings(environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
    """Defaults < config file < SPECMESH_<NAME> variables < overrides (CLI flags; None = unset)."""
    environ = os.environ if environ is None else environ
    flags = {name: value for name, value in overrides.items() if value is not None}
    unknown = sorted(set(flags) - set(Settings.model_fields))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}")
    env = _from_environ(environ)
    path = flags.get("config") or env.get("config", "")
    layers = [("config file " + path, _from_config_file(path) if path else {}),
              ("environment", env), ("flag", flags)]
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, values in layers:
        for name, value in values.items():
            merged[name], origin[name] = value, source
    try:
        return Settings(**merged)
    except ValidationError as exc:
        raise ValueError(_explain(exc, merged, origin)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The whole mesh config file (YAML mapping); `settings:` is read here, other keys elsewhere."""
    import yaml

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping at the top level")
    return data


def default_of(name: str) -> Any:
    """The declared default of setting `name`: service configs take their defaults from here,
    so a default is written once."""
    return Settings.model_fields[name].default


def allowed_values(name: str) -> tuple:
    """The allowed values of a setting declared as a Literal."""
    return get_args(Settings.model_fields[name].annotation)


def setting_help(name: str) -> str:
    """Help text of one setting: description, default, environment variable."""
    field = Settings.model_fields[name]
    return f"{field.description} (default {field.default!r}; env {ENV_PREFIX}{name.upper()})"


# ---- helpers ----------------------------------------------------------------
def _from_environ(environ) -> dict[str, str]:
    values = {}
    for name in Settings.model_fields:
        raw = environ.get(f"{ENV_PREFIX}{name.upper()}")
        if raw is None and name in _ENV_ALIASES:
            raw = environ.get(_ENV_ALIASES[name])
        if raw is not None:
            values[name] = raw
    return values


def _from_config_file(path: str) -> dict[str, Any]:
    section = read_config_file(path).get("settings") or {}
    if not isinstance(section, dict):
        raise ValueError(f"config file {path}: `settings:` must be a mapping")
    if "config" in section:
        raise ValueError(f"config file {path}: `config` cannot be set inside a config file")
    return {str(k).replace("-", "_"): v for k, v in section.items()}


def _explain(exc: ValidationError, merged: dict, origin: dict) -> str:
    lines = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else "?"
        if error["type"] == "extra_forbidden":
            lines.append(f"unknown setting {name!r} (from {origin.get(name, '?')})")
            continue
        where = origin.get(name, "default")
        if where == "environment":
            where = f"{ENV_PREFIX}{name.upper()}"
        elif where == "flag":
            where = f"--{name.replace('_', '-')}"
        lines.append(f"invalid setting {name}={merged.get(name)!r} (from {where}): {error['msg']}")
    return "; ".join(lines)
