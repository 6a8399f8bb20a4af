"""The cache service's settings (`settings.cache`), and the stores and retrieval modes it has.

Field names are CacheConfig's; the flat setting names that say "cache" (`cache_backend`,
`cache_max_memory_mb`, `cache_replicas`) are their aliases. A CacheConfig built without the
settings (tests, benchmarks) is checked against these same declarations.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from services.common.settings_group import SettingsGroup

Backend = Literal["memory", "redis"]  # one process, or shared by all cache replicas
BACKENDS: tuple[str, ...] = get_args(Backend)
RetrievalMode = Literal["bm25", "dense", "hybrid"]  # hybrid: reciprocal rank fusion of both
RETRIEVAL_MODES: tuple[str, ...] = get_args(RetrievalMode)


class CacheSettings(SettingsGroup):
    backend: Backend = Field("memory", alias="cache_backend",
                             description="cache service store: memory (one process) or redis (shared)")
    redis_url: str = Field("", description="Redis URL for cache_backend redis (redis://host:port/db)")
    replicas: str = Field("", alias="cache_replicas", description="target addresses (comma-separated) "
                          "whose KV events the cache's prefix index follows; '' = the mesh config's "
                          "pool replicas, else target_address")
    max_memory_mb: int = Field(256, gt=0, alias="cache_max_memory_mb", description="memory cache "
                               "backend: size bound of cached results before least-recently-used eviction")
    retrieval_mode: RetrievalMode = Field(
        "bm25", description="cache service retrieval scoring; dense and hybrid (rank fusion with BM25) "
        "need the `dense` extra (offline all-MiniLM-L6-v2) or embedding_model")
    embedding_model: str = Field("", description="dense / hybrid retrieval: local sentence-embedding "
                                 "model directory; '' = the `dense` extra's all-MiniLM-L6-v2")

    def config_fields(self) -> dict:
        """The fields CacheConfig takes as they are (it holds the memory bound in bytes and the
        replicas resolved, services/builders.py)."""
        return self.model_dump(exclude={"replicas", "max_memory_mb"})
