"""The mesh configuration: model pools, tenants, tenant classes (λ weights) and risk rules.

One YAML file (`--config`, the same for `specmesh up`, `serve` and compose) describes the
mesh the router routes over. Every part is a dataclass validated on
construction; `load_mesh_config` names the offending field (`pools.small.max_context: ...`).
Without a file the mesh is one pool `default` with the default model and the configured
target address(es), and the `--tokens` tenants in class `default` (`default_mesh_config`).

```yaml
pools:
  small:
    model: /models/small          # "default" or a local HF directory (its tokenizer routes)
    replicas: ["10.0.0.1:50052", "dns:///target-small.specmesh.svc:50052"]
    price_prompt_per_1k: 0.1      # cost units per 1,000 prompt tokens
    price_completion_per_1k: 0.4
    max_context: 2048             # prompt + max_tokens above this never go here (0 = no limit)
    quality: {"code-*": 0.3, "*": 0.6}   # prior per bucket (glob, first match wins)
    escalate_to: large            # optional
    escalate_buckets: ["chat-*"]
    min_mean_logprob: -2.5        # escalate below this mean log-prob of chosen tokens
    min_margin: 0.0               # ... or below this mean top-1/top-2 log-prob margin
tenants:
  acme: {token: "secret-1", class: premium, priority: 2, max_concurrent: 8,
         tokens_per_second: 2000, risk_flags: [regulated], access_labels: [staff]}
classes:
  premium: {cost: 0.1, latency: 1.0, quality: 5.0, risk: 1.0}
risk_rules:
  - {name: ssn, pattern: "\\d{3}-\\d{2}-\\d{4}", force_pool: large}
  - {name: regulated, tenant_flag: regulated, penalty: {small: 10}}
```
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from services.common.request_checks import MAX_PRIORITY, MIN_PRIORITY, priority_violations

DEFAULT_POOL = "default"
DEFAULT_CLASS = "default"
DNS_PREFIX = "dns:///"  # a replica entry "dns:///name:port": every address `name` resolves to (services/common/dns_replicas.py)


class MeshConfigError(ValueError):
    """The mesh configuration is invalid; the message names the field."""


@dataclass(frozen=True)
class Weights:
    """λ weights of the pool objective: argmin λ1·cost + λ2·latency − λ3·quality + λ4·risk."""

    cost: float = 1.0
    latency: float = 1.0
    quality: float = 1.0
    risk: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            _non_negative(f.name, getattr(self, f.name))


@dataclass(frozen=True)
class PoolConfig:
    name: str
    replicas: tuple[str, ...]
    model: str = "default"
    price_prompt_per_1k: float = 0.0
    price_completion_per_1k: float = 0.0
    max_context: int = 0  # 0 = no router-side limit (the target still checks its model's)
    quality: Mapping[str, float] = field(default_factory=lambda: {"*": 0.5})
    escalate_to: str = ""
    escalate_buckets: tuple[str, ...] = ("*",)
    min_mean_logprob: float = -math.inf  # escalate when the answer's mean log-prob is below
    min_margin: float = 0.0  # escalate when the mean top-1/top-2 log-prob margin is below
    tpot_s: float = 0.05  # time per output token before any is measured
    prefill_tokens_per_s: float = 2000.0  # prefill speed for the latency estimate
    model_id: str = ""  # id in prefix-cache keys; "" = what the replicas report in GetStats

    def __post_init__(self) -> None:
        if not self.name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name):
            raise MeshConfigError(f"name: pool names are [A-Za-z0-9_.-]+, got {self.name!r}")
        if not self.replicas:
            raise MeshConfigError("replicas: at least one host:port is required")
        for address in self.replicas:
            _check_address(address)
        if not self.model:
            raise MeshConfigError("model: must not be empty")
        for name in ("price_prompt_per_1k", "price_completion_per_1k", "max_context"):
            _non_negative(name, getattr(self, name))
        for name in ("tpot_s", "prefill_tokens_per_s"):
            _non_negative(name, getattr(self, name))
            if getattr(self, name) == 0:
                raise MeshConfigError(f"{name}: must be > 0")
        if not self.quality:
            raise MeshConfigError("quality: give at least one bucket pattern, e.g. {'*': 0.5}")
        for pattern, prior in self.quality.items():
            _check_number(f"quality.{pattern}", prior)
            if not 0.0 <= prior <= 1.0:
                raise MeshConfigError(f"quality.{pattern}: must be in [0, 1], got {prior}")
        if math.isnan(self.min_mean_logprob) or self.min_mean_logprob > 0:
            raise MeshConfigError(f"min_mean_logprob: must be <= 0, got {self.min_mean_logprob}")
        _non_negative("min_margin", self.min_margin)
        if self.escalate_to == self.name:
            raise MeshConfigError("escalate_to: a pool cannot escalate to itself")

    def quality_for(self, bucket: str) -> float:
        """The prior for `bucket`: the first matching pattern wins; 0 when none matches."""
        for pattern, prior in self.quality.items():
            if fnmatch.fnmatchcase(bucket, pattern):
                return prior
        return 0.0

    def escalates(self, bucket: str) -> bool:
        return bool(self.escalate_to) and any(fnmatch.fnmatchcase(bucket, p) for p in self.escalate_buckets)


@dataclass(frozen=True)
class TenantConfig:
    name: str
    token: str
    tenant_class: str = DEFAULT_CLASS
    priority: int = 0  # higher is admitted first and preempted last by the targets
    max_concurrent: int = 0  # requests in flight at the router; 0 = no limit
    tokens_per_second: float = 0.0  # prompt + max_tokens per second (token bucket); 0 = no limit
    burst_tokens: int = 0  # bucket size; 0 = two seconds' worth (at least one max request)
    risk_flags: tuple[str, ...] = ()
    # Retrieval: the tenant's callers read documents whose labels are all in this set.
    access_labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            raise MeshConfigError("name: must not be empty")
        if not self.token:
            raise MeshConfigError("token: must not be empty")
        if priority_violations(self.priority):  # the range the targets check (services/common/request_checks.py)
            raise MeshConfigError(f"priority: must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {self.priority}")
        for name in ("max_concurrent", "tokens_per_second", "burst_tokens"):
            _non_negative(name, getattr(self, name))


@dataclass(frozen=True)
class RiskRule:
    """Matches when every given condition holds: `pattern` (regex on the prompt), `tenant_flag`."""

    name: str
    pattern: str = ""
    tenant_flag: str = ""
    penalty: Mapping[str, float] = field(default_factory=dict)  # pool -> risk added
    force_pool: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise MeshConfigError("name: must not be empty")
        if not self.pattern and not self.tenant_flag:
            raise MeshConfigError("give pattern and/or tenant_flag")
        if not self.penalty and not self.force_pool:
            raise MeshConfigError("give penalty and/or force_pool")
        if self.pattern:
            try:
                object.__setattr__(self, "_regex", re.compile(self.pattern))
            except re.error as exc:
                raise MeshConfigError(f"pattern: not a regular expression: {exc}") from None
        for pool, value in self.penalty.items():
            _non_negative(f"penalty.{pool}", value)

    def matches(self, prompt: str, tenant_flags: tuple[str, ...]) -> bool:
        if self.tenant_flag and self.tenant_flag not in tenant_flags:
            return False
        return not self.pattern or self._regex.search(prompt) is not None


@dataclass(frozen=True)
class MeshConfig:
    pools: tuple[PoolConfig, ...]
    tenants: tuple[TenantConfig, ...] = ()
    classes: Mapping[str, Weights] = field(default_factory=lambda: {DEFAULT_CLASS: Weights()})
    risk_rules: tuple[RiskRule, ...] = ()

    def __post_init__(self) -> None:
        if not self.pools:
            raise MeshConfigError("pools: at least one pool is required")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise MeshConfigError(f"pools: duplicate pool names in {names}")
        if DEFAULT_CLASS not in self.classes:
            object.__setattr__(self, "classes", {DEFAULT_CLASS: Weights(), **self.classes})
        for pool in self.pools:
            if pool.escalate_to and pool.escalate_to not in names:
                raise MeshConfigError(f"pools.{pool.name}.escalate_to: unknown pool {pool.escalate_to!r}")
        tokens = [t.token for t in self.tenants]
        if len(set(tokens)) != len(tokens):
            raise MeshConfigError("tenants: two tenants share a token")
        for tenant in self.tenants:
            if tenant.tenant_class not in self.classes:
                raise MeshConfigError(f"tenants.{tenant.name}.class: unknown class {tenant.tenant_class!r}")
        for i, rule in enumerate(self.risk_rules):
            for pool in [*rule.penalty, *([rule.force_pool] if rule.force_pool else [])]:
                if pool not in names:
                    raise MeshConfigError(f"risk_rules[{i}] ({rule.name}): unknown pool {pool!r}")

    def pool(self, name: str) -> PoolConfig | None:
        return next((p for p in self.pools if p.name == name), None)

    def tenant(self, name: str) -> TenantConfig | None:
        return next((t for t in self.tenants if t.name == name), None)

    def tokens(self) -> dict[str, str]:
        """Bearer token -> tenant."""
        return {t.token: t.name for t in self.tenants}

    def weights_for(self, tenant: str) -> Weights:
        config = self.tenant(tenant)
        return self.classes[config.tenant_class if config else DEFAULT_CLASS]


def default_mesh_config(target_addresses: list[str], tokens: dict[str, str],
                        model: str = "default") -> MeshConfig:
    """No config file: one pool `default` over the target address(es); tenants from `tokens`."""
    pool = PoolConfig(name=DEFAULT_POOL, replicas=tuple(target_addresses), model=model)
    tenants = tuple(TenantConfig(name=tenant, token=token) for token, tenant in tokens.items())
    return MeshConfig(pools=(pool,), tenants=tenants)


def load_mesh_config(path: str | Path) -> MeshConfig:
    """Reads and validates a mesh YAML file; errors name the file and the field."""
    import yaml

    path = Path(path).expanduser()
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"mesh config {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise MeshConfigError(f"{path}: not valid YAML: {exc}") from None
    try:
        return mesh_config_from_dict(raw if raw is not None else {})
    except MeshConfigError as exc:
        raise MeshConfigError(f"{path}: {exc}") from None


def mesh_config_from_dict(raw: Any) -> MeshConfig:
    _expect(raw, dict, "")
    _known(raw, {"pools", "tenants", "classes", "risk_rules", "settings"}, "")  # settings: env.py
    pools = tuple(_build(PoolConfig, {"name": name, **_expect(body, dict, f"pools.{name}")}, f"pools.{name}")
                  for name, body in _expect(raw.get("pools") or {}, dict, "pools").items())
    tenants = tuple(_build(TenantConfig, {"name": name, **_rename(_expect(body, dict, f"tenants.{name}"))},
                           f"tenants.{name}")
                    for name, body in _expect(raw.get("tenants") or {}, dict, "tenants").items())
    classes = {name: _build(Weights, _expect(body, dict, f"classes.{name}"), f"classes.{name}")
               for name, body in _expect(raw.get("classes") or {}, dict, "classes").items()}
    rules = tuple(_build(RiskRule, _expect(body, dict, f"risk_rules[{i}]"), f"risk_rules[{i}]")
                  for i, body in enumerate(_expect(raw.get("risk_rules") or [], list, "risk_rules")))
    return MeshConfig(pools=pools, tenants=tenants, classes=classes or {DEFAULT_CLASS: Weights()},
                      risk_rules=rules)


# ---- helpers ------------------------------------------------------------------
def _build(cls, body: dict, where: str):
    """cls(**body) with types checked per field; any error is prefixed with `where`."""
    known = {f.name: f for f in fields(cls)}
    _known(body, set(known), where)
    kwargs = {name: _coerce(value, known[name].type, f"{where}.{name}") for name, value in body.items()}
    try:
        return cls(**kwargs)
    except MeshConfigError as exc:
        raise MeshConfigError(f"{where}.{exc}" if not str(exc).startswith("give") else f"{where}: {exc}") from None
    except TypeError as exc:  # a required field is missing
        raise MeshConfigError(f"{where}: {exc}") from None


def _coerce(value: Any, kind: str, where: str):
    if kind == "str":
        return _expect(value, str, where)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise MeshConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MeshConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if kind.startswith("tuple[str"):
        return tuple(_expect(v, str, f"{where}[{i}]") for i, v in enumerate(_expect(value, list, where)))
    if kind.startswith("Mapping[str, float]"):
        return {str(k): _coerce(v, "float", f"{where}.{k}") for k, v in _expect(value, dict, where).items()}
    raise MeshConfigError(f"{where}: unsupported field type {kind}")


def _rename(body: dict) -> dict:
    """YAML says `class`; the dataclass field is `tenant_class` (class is a Python keyword)."""
    body = dict(body)
    if "class" in body:
        body["tenant_class"] = body.pop("class")
    return body


def _expect(value: Any, kind: type, where: str):
    if not isinstance(value, kind):
        names = {dict: "a mapping", list: "a list", str: "a string"}
        raise MeshConfigError(f"{where or 'the file'}: expected {names.get(kind, kind.__name__)}, "
                              f"got {type(value).__name__} {value!r}")
    return value


def _known(body: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise MeshConfigError(f"{where or 'top level'}: unknown field(s) {unknown}; "
                              f"expected some of {sorted(allowed)}")


def _check_number(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise MeshConfigError(f"{name}: must be a finite number, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    _check_number(name, value)
    if value < 0:
        raise MeshConfigError(f"{name}: must be >= 0, got {value}")


def _check_address(address: str) -> None:
    rest = address[len(DNS_PREFIX):] if address.startswith(DNS_PREFIX) else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MeshConfigError(f"replicas: {address!r} is not host:port (or {DNS_PREFIX}name:port)")
