"""compose.yaml is checked by parsing it: no Docker engine runs here."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.cli import SERVICES, _parser
from services.common.env import DEFAULT_PORTS

ROOT = Path(__file__).resolve().parent.parent


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_every_specmesh_service_runs_a_cli_command_on_its_default_port():
    services = _compose()["services"]
    specmesh = {name: s for name, s in services.items() if s.get("image") == "specmesh:latest"}
    assert set(specmesh) == set(SERVICES)
    parser = _parser()
    for name, service in specmesh.items():
        command = service["command"]
        assert command[:3] == ["specmesh", "serve", name]
        args = parser.parse_args(command[1:])  # exits (fails the test) on an unknown flag
        assert args.service == name
        assert args.port == DEFAULT_PORTS[name]
        assert service["ports"] == [f"{DEFAULT_PORTS[name]}:{DEFAULT_PORTS[name]}"]
        assert service["build"] == "."


def test_addresses_between_services_use_the_default_ports():
    env = _compose()["services"]["router"]["environment"]
    for name in ("target", "draft", "cache"):
        assert env[f"SPECMESH_{name.upper()}_ADDRESS"] == f"{name}:{DEFAULT_PORTS[name]}"


def test_infrastructure_and_files_it_names_exist():
    compose = _compose()
    assert {"redis", "otel-collector", "jaeger"} <= set(compose["services"])
    assert (ROOT / "Dockerfile").is_file()
    collector = compose["services"]["otel-collector"]["volumes"][0].split(":")[0]
    config = yaml.safe_load((ROOT / collector).read_text())
    assert "otlp" in config["receivers"]
    for service in compose["services"].values():
        for dep in service.get("depends_on", {}) or {}:
            assert dep in compose["services"]
    cache_cmd = compose["services"]["cache"]["command"]
    assert cache_cmd[cache_cmd.index("--redis-url") + 1].startswith("redis://redis:6379")
