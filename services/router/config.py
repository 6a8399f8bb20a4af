"""Router configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.limits import RequestLimits
from services.common.mesh_config import MeshConfig, default_mesh_config
from services.common.tls import MeshTls
from services.router.replicas import POLICIES

SPECULATION_METHODS = ("off", "prompt_lookup", "suffix", "draft_model", "dynamic_tree", "grammar")


@dataclass(frozen=True)
class RouterConfig:
    target_address: str
    # Bearer token -> tenant. The tenant of a call comes only from here.
    tokens: dict[str, str] = field(default_factory=dict)
    # Secret mixed into tenant salts (HMAC); replicas of one deployment must share it.
    salt_secret: str = "specmesh-dev-secret"
    max_tokens_limit: int = 4096
    # Prompt bytes and stop sequences, checked before any work (services/common/limits.py).
    limits: RequestLimits = RequestLimits()
    default_timeout_s: float = 300.0  # used when the caller sets no deadline
    # Speculation plan for every bucket for now: method name (see SPECULATION_METHODS) and limits.
    speculation_method: str = "prompt_lookup"
    speculation_depth: int = 5
    speculation_nodes: int = 0  # tree node budget; 0 = a chain of `speculation_depth` nodes
    # "fixed": every bucket gets the plan above; "adaptive": depth per bucket from measured
    # acceptance, off where it does not pay (services/router/speculation_policy.py). Served
    # routers take the default from the settings (adaptive, services/common/env.py); a router
    # built directly, as tests do, gets the deterministic fixed plan unless it asks.
    speculation_policy: str = "fixed"
    # The router's mesh identity for its calls to targets and the cache (services/common/tls.py
    # MeshTls); None = plaintext (dev mode, tests).
    mesh_tls: MeshTls | None = None
    # Routing (services/router/routing.py): pools, tenants, classes, risk rules. None = one pool
    # "default" over `target_address` (comma-separated replicas) with the `tokens` tenants.
    mesh: MeshConfig | None = None
    replica_policy: str = "kv_aware"  # kv_aware | least_loaded | round_robin
    cache_address: str = ""  # the cache service (prefix index); "" = replica choice by load only
    poll_interval_s: float = 1.0  # replica health checks and stats
    model_cache: str = "~/.cache/specmesh/models"  # where pool model "default" (its tokenizer) lives

    def __post_init__(self) -> None:
        if self.mesh is None:
            if not self.target_address:
                raise ValueError("target_address must not be empty")
            addresses = [a.strip() for a in self.target_address.split(",") if a.strip()]
            object.__setattr__(self, "mesh", default_mesh_config(addresses, self.tokens))
        else:  # the mesh config's tenants join the token list
            object.__setattr__(self, "tokens", {**self.tokens, **self.mesh.tokens()})
        if self.replica_policy not in POLICIES:
            raise ValueError(f"replica_policy must be one of {POLICIES}, got {self.replica_policy!r}")
        if not 0 < self.poll_interval_s <= 60:
            raise ValueError(f"poll_interval_s must be in (0, 60], got {self.poll_interval_s}")
        if not self.tokens:
            raise ValueError("at least one bearer token must be configured (token=tenant)")
        for token, tenant in self.tokens.items():
            if not token or not tenant:
                raise ValueError("tokens and tenants must be non-empty strings")
        if self.max_tokens_limit <= 0:
            raise ValueError(f"max_tokens_limit must be > 0, got {self.max_tokens_limit}")
        if self.speculation_method not in SPECULATION_METHODS:
            raise ValueError(f"speculation_method must be one of {sorted(SPECULATION_METHODS)}, "
                             f"got {self.speculation_method!r}")
        if not 1 <= self.speculation_depth <= 16:
            raise ValueError(f"speculation_depth must be in [1, 16], got {self.speculation_depth}")
        if not 0 <= self.speculation_nodes <= 64:
            raise ValueError(f"speculation_nodes must be in [0, 64], got {self.speculation_nodes}")
        if self.speculation_policy not in ("fixed", "adaptive"):
            raise ValueError(f"speculation_policy must be 'fixed' or 'adaptive', got {self.speculation_policy!r}")
        if self.default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be > 0, got {self.default_timeout_s}")


def parse_tokens(spec: str) -> dict[str, str]:
    """Parses "token1=tenantA,token2=tenantB" into a dict; raises ValueError on bad entries."""
    tokens = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        token, sep, tenant = entry.partition("=")
        if not sep or not token or not tenant:
            raise ValueError(f"bad token entry {entry!r}; expected TOKEN=TENANT")
        tokens[token] = tenant
    return tokens
