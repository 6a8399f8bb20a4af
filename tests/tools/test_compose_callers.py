"""compose.yaml, ALLOWED_CALLERS (services/common/tls.py) and the code agree on who calls whom:
each internal service's `dev.specmesh.callers` label in compose.yaml names exactly the
identities ALLOWED_CALLERS admits to it, and only those services' code builds its client stub."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from services.common.tls import ALLOWED_CALLERS

ROOT = Path(__file__).resolve().parents[2]
SERVICE_OF = {"target": "TargetService", "draft": "DraftService", "cache": "CacheService"}


def _allowed(service: str) -> set[str]:
    prefix = f"/specmesh.v1.{SERVICE_OF[service]}/"
    return set().union(*(who for path, who in ALLOWED_CALLERS.items() if path.startswith(prefix)))


def _stub_users(service: str) -> set[str]:
    """The services whose code (services/<name>/) builds a stub of `service`. `specmesh status`
    (services/status.py) calls in with the router's certificate (`_mesh_tls`), so it counts as
    the router."""
    users = set()
    for path in (ROOT / "services").rglob("*.py"):
        if re.search(rf"\b{SERVICE_OF[service]}Stub\(", path.read_text()):
            part = path.relative_to(ROOT / "services").parts[0]
            users.add("router" if part == "status.py" else part)
    return users


def test_compose_labels_name_the_callers_tls_admits():
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name in SERVICE_OF:
        assert set(services[name]["labels"]["dev.specmesh.callers"].split()) == _allowed(name), name


def test_only_admitted_callers_build_client_stubs():
    for name in SERVICE_OF:
        assert _stub_users(name) <= _allowed(name), name
    assert _stub_users("cache") == {"router"}  # the target publishes KV events; it never calls the cache
