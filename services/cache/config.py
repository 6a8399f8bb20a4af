"""Cache service configuration, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from services.common.server import ServerConfig

BACKENDS = ("memory", "redis")


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
    backend: str = "memory"  # "memory" (one process) or "redis" (shared by all cache replicas)
    redis_url: str | None = None  # required for backend "redis"
    # Prefix of every key, so several deployments (or test runs) can share one Redis.
    namespace: str = "specmesh"
    max_ttl_seconds: int = 86400
    max_value_bytes: int = 4 * 1024 * 1024
    max_key_bytes: int = 1024
    # A backend operation taking longer than this answers UNAVAILABLE.
    backend_timeout_seconds: float = 2.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "redis":
            if not self.redis_url:
                raise ValueError("backend 'redis' needs redis_url (e.g. redis://127.0.0.1:6379/0)")
            RedisEndpoint.parse(self.redis_url)
        elif self.redis_url:
            raise ValueError("redis_url is set but backend is 'memory'; set backend='redis' or drop redis_url")
        if not self.namespace or ":" in self.namespace:
            raise ValueError(f"namespace must be non-empty and contain no ':', got {self.namespace!r}")
        for name in ("max_ttl_seconds", "max_value_bytes", "max_key_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not (math.isfinite(self.backend_timeout_seconds) and self.backend_timeout_seconds > 0):
            raise ValueError(f"backend_timeout_seconds must be > 0, got {self.backend_timeout_seconds}")

    @property
    def redis_endpoint(self) -> RedisEndpoint | None:
        return RedisEndpoint.parse(self.redis_url) if self.backend == "redis" else None
