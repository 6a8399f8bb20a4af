"""The router's settings (`settings.router`), and the replica policies it chooses among.

Field names are RouterConfig's (`poll_interval_s` keeps its flat setting name
`replica_poll_seconds` as its alias), so the composition root passes the group through, and a
RouterConfig built without the settings (tests, benchmarks) is checked against these same
declarations. The speculation plan's methods, modes and limits are declared in
services/common/speculation_plan.py, shared with the target and the draft service.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator

from services.common.env import DEV_SALT_SECRET, DEV_TOKEN
from services.common.settings_group import SettingsGroup
from services.common.speculation_plan import (
    MAX_DEPTH,
    MAX_NODES,
    SPECULATION_METHODS,
    SpeculationPolicyMode,
)
from services.router.speculation_methods import AUTO, parse_entries, spec_of

# Longest cached prefix (the cache service's prefix index) against load, least loaded, or in
# turn (services/router/replicas.py).
ReplicaPolicy = Literal["kv_aware", "least_loaded", "round_robin"]
REPLICA_POLICIES: tuple[str, ...] = get_args(ReplicaPolicy)
MAX_POLL_SECONDS = 60.0
# The router's method setting: one method forced for every bucket, or `auto` (per bucket and
# pool from `speculation_methods` and measured acceptance: services/router/speculation_methods.py).
PlanMethod = Literal[(*SPECULATION_METHODS, AUTO)]


class RouterSettings(SettingsGroup):
    tokens: str = Field(f"{DEV_TOKEN}=default",
                        description="bearer tokens the router accepts: TOKEN=TENANT,...")
    salt_secret: str = Field(DEV_SALT_SECRET,
                             description="secret the router derives per-tenant prefix-cache salts from")
    speculation_method: PlanMethod = Field(
        AUTO, description="speculative decoding method the router plans: 'auto' = per bucket and pool "
        "from speculation_methods and measured acceptance; any other forces it on every bucket "
        "(requests with a constraint get grammar drafts unless 'off'; 'grammar' = only they speculate)")
    speculation_methods: str = Field(
        "", description="methods per bucket under 'auto': [POOL:]BUCKET_GLOB=METHOD[|METHOD...],... "
        "(first match wins; several = measured, the best kept); defaults follow: structured-*=grammar, "
        "chat-*=eagle|prompt_lookup where an eagle head is set, rewrite/summarize/code-*="
        "prompt_lookup|suffix, *=prompt_lookup")
    speculation_depth: int = Field(5, gt=0, le=MAX_DEPTH, description="draft tokens per verify pass (chain depth)")
    speculation_nodes: int = Field(0, ge=0, le=MAX_NODES, description="draft tree node budget; 0 = a chain")
    speculation_policy: SpeculationPolicyMode = Field(
        "adaptive", description="adaptive depth per bucket and per step from predicted and measured "
        "acceptance, load and step times (docs/p99_incident.md), or the fixed plan for every request")
    replica_policy: ReplicaPolicy = Field(
        "kv_aware", description="router's replica choice in a pool: longest cached prefix (cache "
        "service's prefix index) against load, least loaded, or in turn")
    poll_interval_s: float = Field(1.0, gt=0, le=MAX_POLL_SECONDS, alias="replica_poll_seconds",
                                   description="router's health and stats poll of every replica "
                                   "(ejection and rejoin)")

    @field_validator("speculation_methods", mode="before")
    @classmethod
    def _methods(cls, value):
        """A config-file mapping becomes the entry text; the entries are checked here, so a bad
        one names the setting and where it came from."""
        value = spec_of(value)
        if isinstance(value, str):
            parse_entries(value)
        return value

    def config_fields(self) -> dict:
        """The fields RouterConfig takes as they are (it holds the tokens parsed)."""
        return self.model_dump(exclude={"tokens"})
