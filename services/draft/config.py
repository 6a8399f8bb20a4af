"""Draft service configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.server import ServerConfig


@dataclass(frozen=True)
class DraftConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    # Largest max_depth / max_nodes a request may ask for.
    max_depth_limit: int = 16
    max_nodes_limit: int = 64
    # Most committed tokens one sequence may hold (prompt + generated).
    max_history_tokens: int = 65536
    # Most open sequences; opening more answers RESOURCE_EXHAUSTED until some are released.
    max_sequences: int = 4096
    # Prompt lookup: n-gram sizes tried, longest first.
    prompt_lookup_max_ngram: int = 3
    prompt_lookup_min_ngram: int = 1

    def __post_init__(self) -> None:
        for name in ("max_depth_limit", "max_nodes_limit", "max_history_tokens", "max_sequences"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 1 <= self.prompt_lookup_min_ngram <= self.prompt_lookup_max_ngram:
            raise ValueError("need 1 <= prompt_lookup_min_ngram <= prompt_lookup_max_ngram, got "
                             f"{self.prompt_lookup_min_ngram} and {self.prompt_lookup_max_ngram}")
