"""Draft service configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.common.env import MODEL_DTYPES, MeshSettings
from services.common.server import ServerConfig
from services.common.speculation_plan import MAX_DEPTH, MAX_NODES


@dataclass(frozen=True)
class DraftConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    # Largest max_depth / max_nodes a request may ask for.
    max_depth_limit: int = MAX_DEPTH
    max_nodes_limit: int = MAX_NODES
    # Most committed tokens one sequence may hold (prompt + generated).
    max_history_tokens: int = 65536
    # Most open sequences; opening more answers RESOURCE_EXHAUSTED until some are released.
    max_sequences: int = 4096
    # A sequence not proposed for this long is dropped as if released (its target's Release
    # was lost); live sequences are touched every speculating step.
    sequence_ttl_s: float = 600.0
    # Prompt lookup: n-gram sizes tried, longest first.
    prompt_lookup_max_ngram: int = 3
    prompt_lookup_min_ngram: int = 1
    # Suffix decoding: longest suffix matched; output tokens kept per tenant (oldest
    # dropped first); tenants kept (least recently used dropped first); occurrences
    # of the matched suffix counted (most recent first).
    suffix_max_match: int = 32
    suffix_tenant_max_tokens: int = 65536
    suffix_max_tenants: int = 1024
    suffix_max_occurrences: int = 256
    # Draft model (enables DRAFT_MODEL and DYNAMIC_TREE): a local Hugging Face causal LM
    # directory that shares the target's tokenizer; None = those methods answer
    # FAILED_PRECONDITION. Loaded once when the service is built.
    draft_model_dir: Path | None = None
    draft_model_dtype: str = MeshSettings.model_fields["dtype"].default  # the mesh's `dtype`
    draft_model_device: str = "cpu"
    draft_model_prefill_chunk: int = 512  # prompt tokens per draft forward pass
    # Dynamic trees: children per expanded node, and nodes expanded per depth.
    dynamic_tree_top_k: int = 4
    # Feature head (enables EAGLE): a head file from `specmesh draft train` and the target model
    # directory it was trained for (its embedding, final norm and LM head are loaded from there;
    # a head for another model is refused). None = EAGLE answers FAILED_PRECONDITION.
    eagle_head_path: Path | None = None
    eagle_target_dir: Path | None = None
    # True for a head the mesh picked by itself (`eagle_head` auto): one that does not fit the
    # target is skipped with a warning instead of refusing to start.
    eagle_optional: bool = False

    def __post_init__(self) -> None:
        if self.draft_model_dir is not None:
            object.__setattr__(self, "draft_model_dir", Path(self.draft_model_dir).expanduser())
        for name in ("eagle_head_path", "eagle_target_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)).expanduser())
        if (self.eagle_head_path is None) != (self.eagle_target_dir is None):
            raise ValueError("eagle_head_path and eagle_target_dir go together (the head and its target)")
        if self.draft_model_dtype not in MODEL_DTYPES:
            raise ValueError(f"draft_model_dtype must be one of {MODEL_DTYPES}, "
                             f"got {self.draft_model_dtype!r}")
        for name in ("max_depth_limit", "max_nodes_limit", "max_history_tokens", "max_sequences",
                     "suffix_max_match", "suffix_tenant_max_tokens", "suffix_max_tenants",
                     "suffix_max_occurrences", "draft_model_prefill_chunk", "dynamic_tree_top_k"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.sequence_ttl_s > 0:
            raise ValueError(f"sequence_ttl_s must be > 0, got {self.sequence_ttl_s}")
        if not 1 <= self.prompt_lookup_min_ngram <= self.prompt_lookup_max_ngram:
            raise ValueError("need 1 <= prompt_lookup_min_ngram <= prompt_lookup_max_ngram, got "
                             f"{self.prompt_lookup_min_ngram} and {self.prompt_lookup_max_ngram}")
