"""The settings tree: the mesh-wide settings with one group per service nested in it.

    Settings                      services/common/env.py MeshSettings: host, ports, addresses,
    │                             TLS, telemetry, model, dtype, max_tokens_limit, max_samples
    ├── limits: RequestLimits     services/common/limits.py (router and target check them)
    ├── target: TargetSettings    services/target/settings.py (kernels, weights, KV pool, queues)
    ├── router: RouterSettings    services/router/settings.py (tokens, speculation plan, replicas)
    ├── draft:  DraftSettings     services/draft/settings.py (draft LM)
    └── cache:  CacheSettings     services/cache/settings.py (store, retrieval)

Why this shape: a service's group is declared in that service, beside the code that owns
its values (the kernel backends beside the kernels, the replica policies beside the router),
so each allowed-value list and each limit is written once, and the composition root
(services/builders.py) hands each service its group instead of copying fields one by one.
What more than one service reads stays at the top (the request limits both the router and
the target enforce, the dtype of both models). The tree is assembled here, beside the CLI
and the composition root, because services/common imports no service.

Users see no nesting: every setting keeps its flat name (SPECMESH_NUM_BLOCKS, --num-blocks,
`num_blocks:` under `settings:` in the config file), read by services/common/env.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from services.cache.settings import CacheSettings
from services.common import env
from services.common.env import MeshSettings
from services.draft.settings import DraftSettings
from services.router.settings import RouterSettings
from services.target.settings import TargetSettings


class Settings(MeshSettings):
    """Settings for all services; services/builders.py gives each service its group."""

    target: TargetSettings = Field(default_factory=TargetSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    draft: DraftSettings = Field(default_factory=DraftSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)


def read_settings(environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
    """Defaults < config file < SPECMESH_<NAME> variables < overrides (CLI flags; None = unset)."""
    return env.read_settings(environ, tree=Settings, **overrides)


def setting_names() -> tuple[str, ...]:
    """Every setting's flat name (a flag, an environment variable and a config-file key)."""
    return tuple(env.setting_fields(Settings))


def setting_help(name: str) -> str:
    return env.setting_help(Settings, name)


def setting_value(settings: Settings, name: str) -> Any:
    """The value of setting `name` (`num_blocks` -> settings.target.num_blocks)."""
    return env.setting_value(settings, name)
