"""Cache service configuration, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from services.cache.settings import CacheSettings
from services.common.env import check_declared
from services.common.server import ServerConfig
from services.common.tls import MeshTls

# Defaults and allowed values of the fields that are settings are declared once, in the
# cache's settings group (services/cache/settings.py).
_CACHE = CacheSettings()
_CHECKED_FIELDS = ("backend", "retrieval_mode", "embedding_model")


@dataclass(frozen=True)
class RedisEndpoint:
    """Where the Redis backend lives, parsed from `redis[s]://[[user]:password@]host[:port][/db]`."""

    host: str
    port: int = 6379
    db: int = 0
    password: str | None = None
    ssl: bool = False

    @classmethod
    def parse(cls, url: str) -> RedisEndpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"redis_url must start with redis:// or rediss://, got scheme {parts.scheme!r}")
        try:
            port = parts.port or 6379
        except ValueError:
            raise ValueError("redis_url has an invalid port") from None
        if not parts.hostname:
            raise ValueError("redis_url has no host")
        db_text = parts.path.strip("/") or "0"
        if not db_text.isdigit():
            raise ValueError(f"redis_url database must be a number, got {db_text!r}")
        password = unquote(parts.password) if parts.password else None
        return cls(parts.hostname, port, int(db_text), password, parts.scheme == "rediss")


@dataclass(frozen=True)
class CacheConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    backend: str = _CACHE.backend  # "memory" (one process) or "redis" (shared by all cache replicas)
    redis_url: str | None = None  # required for backend "redis" ("" = None)
    # Prefix of every key, so several deployments (or test runs) can share one Redis.
    namespace: str = "specmesh"
    max_ttl_seconds: int = 86400
    max_value_bytes: int = 4 * 1024 * 1024
    max_key_bytes: int = 1024
    # A backend operation taking longer than this answers UNAVAILABLE.
    backend_timeout_seconds: float = 2.0
    # Memory backend: bytes of results (keys + values) kept before the least recently
    # used are evicted. Corpora are not counted: they are bounded per corpus below.
    max_memory_bytes: int = _CACHE.max_memory_mb << 20
    # Prefix index: target replica addresses whose KV events are followed.
    replicas: tuple[str, ...] = ()
    # The cache's own mesh identity for calling the targets (None = plaintext, dev mode).
    mesh_tls: MeshTls | None = None
    max_prefix_blocks: int = 65536  # block hashes per PrefixMatch
    # Tool-result cache.
    tool_lease_ms: int = 30_000  # default lease; a holder that does not store by then loses it
    max_lease_ms: int = 600_000
    tool_ttl_seconds: int = 300  # default time to live of a stored value
    tool_error_ttl_seconds: int = 5  # cached errors live at most this long
    max_wait_seconds: float = 60.0  # a waiter without a deadline waits at most this long
    max_arguments_bytes: int = 64 * 1024
    # Retrieval.
    retrieval_mode: str = _CACHE.retrieval_mode  # bm25 | dense | hybrid (reciprocal rank fusion of both)
    embedding_model: str = _CACHE.embedding_model  # dense / hybrid: model directory; "" = the `dense` extra's MiniLM
    retrieval_cache: bool = True  # cache results per (tenant, corpus version, labels, query, k)
    retrieval_ttl_seconds: int = 300
    max_documents_per_corpus: int = 100_000
    max_document_bytes: int = 256 * 1024
    max_query_bytes: int = 8 * 1024
    max_k: int = 50

    def __post_init__(self) -> None:
        check_declared(CacheSettings, self, _CHECKED_FIELDS)
        if self.backend == "redis":
            if not self.redis_url:
                raise ValueError("backend 'redis' needs redis_url (e.g. redis://127.0.0.1:6379/0)")
            RedisEndpoint.parse(self.redis_url)
        elif self.redis_url:
            raise ValueError("redis_url is set but backend is 'memory'; set backend='redis' or drop redis_url")
        if not self.namespace or ":" in self.namespace:
            raise ValueError(f"namespace must be non-empty and contain no ':', got {self.namespace!r}")
        object.__setattr__(self, "replicas", tuple(self.replicas))
        if len(set(self.replicas)) != len(self.replicas) or not all(self.replicas):
            raise ValueError(f"replicas must be distinct non-empty addresses, got {list(self.replicas)}")
        for name in ("max_ttl_seconds", "max_value_bytes", "max_key_bytes", "max_memory_bytes",
                     "max_prefix_blocks", "tool_lease_ms", "max_lease_ms", "tool_ttl_seconds",
                     "tool_error_ttl_seconds", "max_arguments_bytes", "retrieval_ttl_seconds",
                     "max_documents_per_corpus", "max_document_bytes", "max_query_bytes", "max_k"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not (math.isfinite(self.backend_timeout_seconds) and self.backend_timeout_seconds > 0):
            raise ValueError(f"backend_timeout_seconds must be > 0, got {self.backend_timeout_seconds}")
        if not (math.isfinite(self.max_wait_seconds) and self.max_wait_seconds > 0):
            raise ValueError(f"max_wait_seconds must be > 0, got {self.max_wait_seconds}")
        if self.tool_lease_ms > self.max_lease_ms:
            raise ValueError(f"tool_lease_ms {self.tool_lease_ms} is above max_lease_ms {self.max_lease_ms}")

    @property
    def redis_endpoint(self) -> RedisEndpoint | None:
        return RedisEndpoint.parse(self.redis_url) if self.backend == "redis" else None
