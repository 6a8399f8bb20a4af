"""compose.yaml is checked by parsing it: no Docker engine runs here."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from services.cli import SERVICES, _parser
from services.common.env import DEFAULT_PORTS

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_every_specmesh_service_runs_a_cli_command_on_its_default_port():
    services = _compose()["services"]
    specmesh = {name: s for name, s in services.items()
                if s.get("image") == "specmesh:latest" and s["command"][:2] == ["specmesh", "serve"]}
    assert set(specmesh) == set(SERVICES)
    parser = _parser()
    for name, service in specmesh.items():
        command = service["command"]
        assert command[:3] == ["specmesh", "serve", name]
        args = parser.parse_args(command[1:])  # exits (fails the test) on an unknown flag
        assert args.service == name
        assert args.port == DEFAULT_PORTS[name]
        if name in ("router", "gateway"):  # the only specmesh services published on the host
            assert service["ports"] == [f"{DEFAULT_PORTS[name]}:{DEFAULT_PORTS[name]}"]
        else:
            assert "ports" not in service
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


# ---- observability ---------------------------------------------------------------------------
PUBLISHED = {"router", "jaeger", "prometheus", "grafana"}  # the router and the UIs


def test_only_the_router_and_the_uis_are_published_and_every_service_has_a_healthcheck():
    services = _compose()["services"]
    assert {name for name, s in services.items() if s.get("ports")} == PUBLISHED | {"gateway"}
    assert {"router", "jaeger", "prometheus", "grafana"} <= {n for n, s in services.items() if s.get("ports")}
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    compose = _compose()
    services = compose["services"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {f"{name}:9464" for name in ("router", "target", "draft", "cache")}
    env = compose["x-specmesh"]["environment"]
    assert env["SPECMESH_METRICS_PORT"] == "9464"
    assert (ROOT / services["prometheus"]["volumes"][0].split(":")[0]).is_file()


def test_traces_go_through_the_collector_to_jaeger_v2():
    services = _compose()["services"]
    assert services["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")
    collector = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    exporters = collector["service"]["pipelines"]["traces"]["exporters"]
    assert any(collector["exporters"][e].get("endpoint", "").startswith("jaeger:") for e in exporters)
    assert _compose()["x-specmesh"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"


def test_grafana_dashboard_is_valid_json_and_queries_existing_metrics():
    import json
    import re

    from services.common.metrics import prometheus_names
    from services.target.metrics import exported_gauges

    services = _compose()["services"]
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in services["grafana"]["volumes"]}
    dashboards = mounts["/var/lib/grafana/dashboards"]
    provisioning = mounts["/etc/grafana/provisioning"]
    provider = yaml.safe_load((provisioning / "dashboards" / "specmesh.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    assert any(d["url"] == "http://prometheus:9090" for d in datasources["datasources"])
    dashboard = json.loads((dashboards / "specmesh.json").read_text())
    known = prometheus_names(exported_gauges())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"]]
    used = {name for e in exprs for name in re.findall(r"\b((?:specmesh|gen_ai|rpc)_[a-z0-9_]+)", e)}
    used -= {"specmesh_bucket", "specmesh_pool", "specmesh_status", "specmesh_model", "specmesh_route"}  # labels
    assert used and used <= known, sorted(used - known)
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("ttft", "tpot", "acceptance length", "rejected", "verify time", "fallbacks",
                  "route distribution", "kv", "prefix-cache hit rate"):
        assert topic in titles, topic
    assert {"P50 {{specmesh_bucket}}", "P99 {{specmesh_bucket}}"} <= {
        t["legendFormat"] for t in dashboard["panels"][0]["targets"]}


def test_image_installs_dependencies_before_the_code_and_keeps_the_baked_model_visible():
    text = (ROOT / "Dockerfile").read_text()
    assert text.index("COPY pyproject.toml") < text.index("pip install -r /tmp/deps.txt") < text.index("COPY services")
    assert "download.pytorch.org/whl/cpu" in text and "ARG VARIANT=cpu" in text and "nvidia/cuda" in text
    baked = re.search(r"ENV SPECMESH_MODEL_CACHE=(\S+)", text).group(1)
    for service in _compose()["services"].values():
        for volume in service.get("volumes", []):
            mount = volume.split(":")[1]
            assert not baked.startswith(mount), f"{volume} hides the baked model at {baked}"


# ---- service credentials -----------------------------------------------------------------------

def test_services_use_mesh_certificates_from_the_certs_volume_and_internal_ports_stay_inside():
    compose = _compose()
    services = compose["services"]
    certs = services["certs"]
    args = _parser().parse_args(certs["command"][1:])
    assert (args.command, args.out) == ("certs", "/certs")
    assert certs["volumes"] == ["certs:/certs"] and certs["restart"] == "no"
    assert "certs" in compose["volumes"]
    assert compose["x-specmesh"]["environment"]["SPECMESH_TLS_DIR"] == "/certs"
    serving = [name for name, s in services.items() if s.get("command", [])[:2] == ["specmesh", "serve"]]
    assert {"router", "target", "draft", "cache"} <= set(serving)
    for name in serving:
        assert "certs:/certs:ro" in services[name]["volumes"], name
    for name in ("router", "target", "draft", "cache"):  # the mesh: certificates before they start
        assert services[name]["depends_on"]["certs"] == {"condition": "service_completed_successfully"}, name
    for name in ("target", "draft", "cache"):  # mutual TLS; health checked with the service's own certificate
        service = services[name]
        assert "ports" not in service and service["expose"] == [str(DEFAULT_PORTS[name])], name
        test = service["healthcheck"]["test"]
        assert test[-2:] == ["--tls-as", name] and test[4] == f"127.0.0.1:{DEFAULT_PORTS[name]}", name
    assert "ports" not in services["redis"] and services["redis"]["expose"] == ["6379"]


def test_the_router_salt_secret_has_no_public_default():
    value = _compose()["services"]["router"]["environment"]["SPECMESH_SALT_SECRET"]
    assert re.fullmatch(r"\$\{SPECMESH_SALT_SECRET:\?[^}$]+\}", value), value  # compose refuses to start without it


def test_the_gateway_listens_on_the_port_its_compose_command_names():
    from services.builders import gateway_config
    from services.settings import read_settings

    command = _compose()["services"]["gateway"]["command"]
    args = _parser().parse_args(command[1:])
    assert gateway_config(read_settings(environ={}, port=args.port)).port == 8000
    assert gateway_config(read_settings(environ={}, port=9001)).port == 9001
    assert gateway_config(read_settings(environ={}, gateway_port=8123)).port == 8123


def test_the_router_tokens_have_no_public_default():
    value = _compose()["services"]["router"]["environment"]["SPECMESH_TOKENS"]
    assert re.fullmatch(r"\$\{SPECMESH_TOKENS:\?[^}$]+\}", value), value  # compose refuses to start without them
