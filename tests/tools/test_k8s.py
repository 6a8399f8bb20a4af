"""deploy/k8s validates offline against the Kubernetes OpenAPI schemas (kubernetes-validate
ships them), the mesh config in its ConfigMap loads, and every container command parses
through the specmesh CLI with that config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.common.mesh_config import mesh_config_from_dict

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
kubernetes_validate = pytest.importorskip("kubernetes_validate")


def _documents() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = kustomization["resources"]
    assert sorted(files) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    return [doc for name in files for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def _containers(docs):
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, container


def test_manifests_validate_against_the_kubernetes_schemas():
    docs = _documents()
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema error
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert {("StatefulSet", "specmesh-target"), ("StatefulSet", "specmesh-cache")} <= set(kinds)
    assert {("Deployment", f"specmesh-{s}") for s in ("router", "draft")} <= set(kinds)


def test_targets_have_gpus_a_headless_service_and_every_container_health_probes():
    docs = _documents()
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    target = _stateful_set(docs, "specmesh-target")
    assert services[target["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    container = target["spec"]["template"]["spec"]["containers"][0]
    # A tensor-parallel target gets one device per rank: the pod's GPUs are its rank count.
    command = container["command"]
    ranks = int(command[command.index("--tensor-parallel") + 1])
    assert container["resources"]["requests"]["nvidia.com/gpu"] == ranks
    assert container["resources"]["limits"]["nvidia.com/gpu"] == ranks
    for _, c in _containers(docs):
        port = c["ports"][0]["containerPort"]
        for probe in (c["readinessProbe"], c["livenessProbe"]):
            if c["name"] == "router":  # the public port: kubelet's native gRPC probe
                assert probe["grpc"]["port"] == port
            else:  # mutual TLS: the healthcheck module with the service's own certificate
                assert probe["exec"]["command"] == ["python", "-m", "services.common.healthcheck",
                                                    f"127.0.0.1:{port}", "--tls-as", c["name"]]
                assert {"name": "SPECMESH_CONFIG", "value": "/etc/specmesh/mesh.yaml"} in c["env"]


def test_pool_replicas_are_the_statefulset_headless_service_by_dns(tmp_path):
    """Scale-out is the StatefulSet's replica count alone: the pool names the headless
    Service (re-resolved), the cache follows the pool, and no pod is listed anywhere."""
    docs = _documents()
    mesh = _mesh(docs)
    target = _stateful_set(docs, "specmesh-target")
    service, ns = target["spec"]["serviceName"], target["metadata"]["namespace"]
    port = target["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert mesh.pool("default").replicas == (f"dns:///{service}.{ns}.svc.cluster.local:{port}",)
    text = _config_text(docs)
    assert "cache_replicas" not in yaml.safe_load(text)["settings"]  # the cache follows the pool
    assert f"{target['metadata']['name']}-0" not in text  # no pod listed
    from services.builders import cache_replicas
    from services.settings import read_settings
    config = tmp_path / "mesh.yaml"
    config.write_text(text)
    assert cache_replicas(read_settings(environ={}, config=str(config))) == mesh.pool("default").replicas


def test_cache_instances_are_the_cache_headless_service_by_dns(tmp_path):
    """The router finds the cache instances the way it finds the targets: `cache_address` is the
    cache StatefulSet's headless Service by DNS (each pod its own name), no pod listed."""
    docs = _documents()
    cache = _stateful_set(docs, "specmesh-cache")
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert services[cache["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    service, ns = cache["spec"]["serviceName"], cache["metadata"]["namespace"]
    port = cache["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    from services.builders import router_config
    from services.router.cache_instances import cache_entries
    from services.settings import read_settings
    config = tmp_path / "mesh.yaml"
    config.write_text(_config_text(docs))
    settings = read_settings(environ={"SPECMESH_TOKENS": "tok=tenant"}, config=str(config))
    address = router_config(settings).cache_address
    assert cache_entries(address) == (f"dns:///{service}.{ns}.svc.cluster.local:{port}",)
    assert f"{cache['metadata']['name']}-0" not in _config_text(docs)


def test_container_commands_parse_through_the_cli(tmp_path):
    from services.cli import _parser
    from services.settings import read_settings
    docs = _documents()
    config = tmp_path / "mesh.yaml"
    config.write_text(_config_text(docs))
    for doc, container in _containers(docs):
        command = container["command"]
        assert command[0] == "specmesh" and command[1:3] == ["serve", container["name"]]
        argv = [a.replace("/etc/specmesh/mesh.yaml", str(config)) for a in command[1:]]
        args = _parser().parse_args(argv)  # argparse exits on an unknown flag or a bad choice
        assert args.service == container["name"]
        settings = read_settings(environ={}, config=str(config))
        assert settings.host == "0.0.0.0"


def _stateful_set(docs, name: str) -> dict:
    return next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == name)


def _config_text(docs) -> str:
    return next(d for d in docs if d["kind"] == "ConfigMap")["data"]["mesh.yaml"]


def _mesh(docs):
    return mesh_config_from_dict(yaml.safe_load(_config_text(docs)))
