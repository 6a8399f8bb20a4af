"""Router configuration, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.env import MeshSettings, check_declared
from services.common.limits import RequestLimits
from services.common.mesh_config import MeshConfig, default_mesh_config
from services.common.tls import MeshTls
from services.router.cache_instances import cache_entries
from services.router.settings import RouterSettings
from services.router.speculation_methods import AUTO, MethodMap

# Defaults, limits and allowed values of the fields that are settings are declared once, in
# the router's settings group (services/router/settings.py; request limits: the mesh's).
_ROUTER = RouterSettings()
_MESH = MeshSettings()
_ROUTER_FIELDS = tuple(_ROUTER.config_fields())
_MESH_FIELDS = ("max_tokens_limit", "max_samples", "model_cache")


@dataclass(frozen=True)
class RouterConfig:
    target_address: str
    # Bearer token -> tenant. The tenant of a call comes only from here.
    tokens: dict[str, str] = field(default_factory=dict)
    # Secret mixed into tenant salts (HMAC); replicas of one deployment must share it.
    salt_secret: str = _ROUTER.salt_secret
    max_tokens_limit: int = _MESH.max_tokens_limit
    max_samples: int = _MESH.max_samples  # largest n (samples of one prompt) a request may ask for
    # Prompt bytes and stop sequences, checked before any work (services/common/limits.py).
    limits: RequestLimits = RequestLimits()
    default_timeout_s: float = 300.0  # used when the caller sets no deadline
    # Speculation plan: the method ("auto" = per bucket and pool from `speculation_methods` and
    # measured acceptance; any other is forced on every bucket) and limits
    # (services/router/speculation_methods.py, services/common/speculation_plan.py).
    speculation_method: str = _ROUTER.speculation_method
    speculation_methods: str = _ROUTER.speculation_methods
    # Pools whose draft service serves a feature head for their model: open text there may
    # run `eagle` by default (services/builders.py: the pools of the `model` when eagle_head is set).
    eagle_pools: tuple[str, ...] = ()
    speculation_depth: int = _ROUTER.speculation_depth
    speculation_nodes: int = _ROUTER.speculation_nodes  # 0 = a chain of `speculation_depth` nodes
    # "fixed": every bucket gets the plan above; "adaptive": depth per bucket from measured
    # acceptance, off where it does not pay (services/router/speculation_policy.py).
    speculation_policy: str = _ROUTER.speculation_policy
    # The router's mesh identity for its calls to targets and the cache (services/common/tls.py
    # MeshTls); None = plaintext (dev mode, tests).
    mesh_tls: MeshTls | None = None
    # Routing (services/router/routing.py): pools, tenants, classes, risk rules. None = one pool
    # "default" over `target_address` (comma-separated replicas) with the `tokens` tenants.
    mesh: MeshConfig | None = None
    replica_policy: str = _ROUTER.replica_policy  # kv_aware | least_loaded | round_robin
    # The cache service (prefix index, retrieval, tool results): HOST:PORT, a comma-separated list,
    # or dns:///NAME:PORT (a headless Service: every instance, re-resolved each poll), calls
    # sharded across the instances by key (services/router/cache_instances.py); "" = none
    # (replica choice by load only).
    cache_address: str = ""
    poll_interval_s: float = _ROUTER.poll_interval_s  # replica health checks and stats
    model_cache: str = _MESH.model_cache  # where pool model "default" (its tokenizer) lives

    def __post_init__(self) -> None:
        if self.mesh is None:
            if not self.target_address:
                raise ValueError("target_address must not be empty")
            addresses = [a.strip() for a in self.target_address.split(",") if a.strip()]
            object.__setattr__(self, "mesh", default_mesh_config(addresses, self.tokens))
        else:  # the mesh config's tenants join the token list
            object.__setattr__(self, "tokens", {**self.tokens, **self.mesh.tokens()})
        check_declared(RouterSettings, self, _ROUTER_FIELDS)
        pools = [p.name for p in self.mesh.pools]
        unknown = sorted(set(self.eagle_pools) - set(pools))
        if unknown:
            raise ValueError(f"eagle_pools: unknown pool(s) {unknown}; the mesh's pools are {pools}")
        self.method_map  # noqa: B018 (an entry naming an unknown pool is refused here)
        check_declared(MeshSettings, self, _MESH_FIELDS)
        if not self.tokens:
            raise ValueError("at least one bearer token must be configured (token=tenant)")
        for token, tenant in self.tokens.items():
            if not token or not tenant:
                raise ValueError("tokens and tenants must be non-empty strings")
        cache_entries(self.cache_address)  # a malformed dns:/// entry is refused here
        if self.default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s must be > 0, got {self.default_timeout_s}")

    @property
    def method_map(self) -> MethodMap:
        """The methods each bucket may run per pool (services/router/speculation_methods.py)."""
        if self.speculation_method != AUTO:
            return MethodMap.forced(self.speculation_method)
        return MethodMap.configured(self.speculation_methods, self.eagle_pools, [p.name for p in self.mesh.pools])


def parse_tokens(spec: str) -> dict[str, str]:
    """Parses "token1=tenantA,token2=tenantB" into a dict; raises ValueError on bad entries."""
    tokens = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        token, sep, tenant = entry.partition("=")
        if not sep or not token or not tenant:
            raise ValueError(f"bad token entry {entry!r}; expected TOKEN=TENANT")
        tokens[token] = tenant
    return tokens
