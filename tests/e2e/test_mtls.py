"""Mutual TLS between services: development certificates, and internal services that refuse
every caller without a mesh certificate of an allowed service."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from specmesh.proto.v1 import (
    cache_service_pb2,
    cache_service_pb2_grpc,
    common_pb2,
    draft_service_pb2,
    draft_service_pb2_grpc,
    target_service_pb2,
    target_service_pb2_grpc,
)
from services.cli import main
from services.builders import build_server
from services.settings import read_settings
from services.common.healthcheck import check
from services.common.server import GrpcServer, ServerConfig
from services.common.tls import (
    ALLOWED_CALLERS,
    SERVICE_IDENTITIES,
    allowed_for,
    MeshTls,
    internal_channel,
    make_dev_certs,
    public_channel,
)
from services.draft.config import DraftConfig
from services.draft.service import SERVICE_NAME as DRAFT_SERVICE
from services.draft.service import DraftService, add_to_server
from tests.mesh import collect, request, start_draft, start_mesh
from tests.processes import free_port

UNAVAILABLE, UNAUTHENTICATED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED
PL = common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_dev_certs(tmp_path_factory.mktemp("mesh-certs"))


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory):
    """Certificates with the same service names from another CA (an outsider's own CA)."""
    return make_dev_certs(tmp_path_factory.mktemp("other-certs"))


# ---- development certificates -----------------------------------------------------------

def test_dev_certs_name_each_service_its_hosts_and_are_signed_by_the_ca(certs):
    assert sorted(os.listdir(certs)) == sorted(
        ["ca.pem"] + [f"{s}{suffix}" for s in SERVICE_IDENTITIES for suffix in (".pem", "-key.pem")])
    ca = x509.load_pem_x509_certificate((certs / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    for name in SERVICE_IDENTITIES:
        cert = x509.load_pem_x509_certificate((certs / f"{name}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == [name, "localhost"]
        assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usages) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        assert stat.S_IMODE((certs / f"{name}-key.pem").stat().st_mode) == 0o600


def _sans(path) -> x509.SubjectAlternativeName:
    return x509.load_pem_x509_certificate(path.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value


def test_dev_certs_add_extra_hosts_and_are_kept_unless_forced(tmp_path):
    make_dev_certs(tmp_path, services=["target", "draft"],
                   hosts=["gpu-1.internal", "10.0.0.7", "localhost", "target=*.targets.svc"])
    cert_pem = (tmp_path / "target.pem").read_bytes()
    sans = _sans(tmp_path / "target.pem")
    assert sans.get_values_for_type(x509.DNSName) == ["target", "localhost", "gpu-1.internal", "*.targets.svc"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1", "10.0.0.7"]
    assert _sans(tmp_path / "draft.pem").get_values_for_type(x509.DNSName) == ["draft", "localhost", "gpu-1.internal"]
    with pytest.raises(ValueError, match="'gateway' is not one of target, draft"):
        make_dev_certs(tmp_path / "bad", services=["target", "draft"], hosts=["gateway=x"])
    make_dev_certs(tmp_path, services=["target"])
    assert (tmp_path / "target.pem").read_bytes() == cert_pem
    make_dev_certs(tmp_path, services=["target"], force=True)
    assert (tmp_path / "target.pem").read_bytes() != cert_pem


# ---- who may call what ------------------------------------------------------------------

def test_allowed_callers_per_method():
    assert {m: allowed_for(m, ALLOWED_CALLERS) for m in (
        "/specmesh.v1.TargetService/Generate", "/specmesh.v1.TargetService/GetStats",
        "/specmesh.v1.TargetService/SubscribeKVEvents", "/specmesh.v1.DraftService/ProposeStream",
        "/specmesh.v1.CacheService/Put", "/specmesh.v1.RouterService/Generate",
        "/grpc.health.v1.Health/Check", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    )} == {
        "/specmesh.v1.TargetService/Generate": {"router"},
        "/specmesh.v1.TargetService/GetStats": {"router"},
        "/specmesh.v1.TargetService/SubscribeKVEvents": {"router", "cache"},
        "/specmesh.v1.DraftService/ProposeStream": {"target"},
        "/specmesh.v1.CacheService/Put": {"router"},
        "/specmesh.v1.RouterService/Generate": frozenset(),  # not served with mutual TLS
        "/grpc.health.v1.Health/Check": None,  # any mesh certificate
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": None,
    }


# ---- the draft service: who may call ----------------------------------------------------

def _callers(certs, other_certs) -> dict[str, grpc.ChannelCredentials | MeshTls | None]:
    ca = (certs / "ca.pem").read_bytes()
    return {
        "no TLS": None,
        "TLS without a client certificate": grpc.ssl_channel_credentials(root_certificates=ca),
        # The outsider trusts our CA (so the server is accepted) but presents its own CA's
        # certificate with the right name.
        "client certificate of another CA": grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=(other_certs / "target-key.pem").read_bytes(),
            certificate_chain=(other_certs / "target.pem").read_bytes()),
    }


def _channel(address: str, credentials) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address)
    if isinstance(credentials, MeshTls):
        return internal_channel(address, credentials)
    return grpc.aio.secure_channel(address, credentials)


@pytest.fixture
async def secured_draft(certs):
    service = DraftService(DraftConfig())
    server = GrpcServer(ServerConfig(port=0, tls=MeshTls.from_dir(certs, "draft").server_tls()),
                        lambda s: add_to_server(s, service), [DRAFT_SERVICE])
    await server.start()
    yield server, service
    await server.stop(0)


def _propose(sequence_id: str) -> draft_service_pb2.ProposeRequest:
    return draft_service_pb2.ProposeRequest(sequences=[draft_service_pb2.DraftSequence(
        sequence_id=sequence_id, new_token_ids=[1, 2, 3, 1, 2], method=PL, max_depth=2,
        tenant_salt="salt-a")])


async def test_draft_refuses_callers_without_a_mesh_certificate(secured_draft, certs, other_certs):
    server, service = secured_draft
    for what, credentials in _callers(certs, other_certs).items():
        async with _channel(server.address, credentials) as channel:
            stub = draft_service_pb2_grpc.DraftServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Propose(_propose(what), timeout=5)
            assert info.value.code() == UNAVAILABLE, what  # the TLS handshake fails
    assert len(service.store) == 0  # no call reached the service


async def test_draft_answers_unauthenticated_to_mesh_services_other_than_the_target(
        secured_draft, certs):
    server, service = secured_draft
    for identity in ("router", "cache", "gateway", "draft"):
        async with internal_channel(server.address, MeshTls.from_dir(certs, identity)) as channel:
            stub = draft_service_pb2_grpc.DraftServiceStub(channel)
            for call in (stub.Propose(_propose(identity), timeout=5),
                         stub.Release(draft_service_pb2.ReleaseRequest(sequence_ids=["x"]), timeout=5)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == UNAUTHENTICATED, identity
                assert info.value.details().startswith(
                    f"service {identity!r} may not call /specmesh.v1.DraftService/")
            stream = stub.ProposeStream(iter([_propose(identity + "-stream")]), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stream:
                    pass
            assert info.value.code() == UNAUTHENTICATED, identity
            # Health answers any mesh certificate (compose healthchecks use the service's own).
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert len(service.store) == 0


async def test_draft_serves_the_target(secured_draft, certs):
    server, service = secured_draft
    async with internal_channel(server.address, MeshTls.from_dir(certs, "target")) as channel:
        response = await draft_service_pb2_grpc.DraftServiceStub(channel).Propose(_propose("s1"), timeout=5)
    assert [list(t.token_ids) for t in response.trees] == [[3, 1]]
    assert len(service.store) == 1


# ---- the cache service: the router only --------------------------------------------------

async def test_cache_serves_the_router_and_refuses_the_rest(certs, other_certs):
    config = CacheConfig(server=ServerConfig(port=0, tls=MeshTls.from_dir(certs, "cache").server_tls()))
    server = build_cache_server(config)
    await server.start()
    tenant = (("specmesh-tenant", "tenant-a"),)
    try:
        get = cache_service_pb2.CacheServiceGetRequest(kind=cache_service_pb2.CACHE_KIND_TOOL, key="k")
        for what, credentials in _callers(certs, other_certs).items():
            async with _channel(server.address, credentials) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await cache_service_pb2_grpc.CacheServiceStub(channel).Get(get, metadata=tenant, timeout=5)
                assert info.value.code() == UNAVAILABLE, what
        for identity in ("target", "draft", "gateway", "cache"):
            async with internal_channel(server.address, MeshTls.from_dir(certs, identity)) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await cache_service_pb2_grpc.CacheServiceStub(channel).Get(get, metadata=tenant, timeout=5)
                assert info.value.code() == UNAUTHENTICATED, identity
        async with internal_channel(server.address, MeshTls.from_dir(certs, "router")) as channel:
            response = await cache_service_pb2_grpc.CacheServiceStub(channel).Get(get, metadata=tenant, timeout=5)
            assert response.found is False
    finally:
        await server.stop(0)


# ---- a whole tiny mesh over mutual TLS --------------------------------------------------

async def test_tiny_mesh_over_mutual_tls_generates_and_speculates_and_refuses_outsiders(
        tiny_llama_dir, certs, other_certs):
    draft = await start_draft(tls_dir=certs)
    mesh = await start_mesh(tiny_llama_dir, tls_dir=certs, draft_address=draft.address,
                            speculation={"speculation_method": "prompt_lookup", "speculation_depth": 4})
    try:
        assert mesh.engine.speculator.client.connected  # the target's certificate reached the draft
        ids, _, last = await collect(mesh.router_stub, request("1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4", 16))
        assert len(ids) == 16
        assert last.usage.proposed_tokens > 0
        stats = target_service_pb2.GetStatsRequest()
        for what, credentials in _callers(certs, other_certs).items():
            async with _channel(mesh.target.address, credentials) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await target_service_pb2_grpc.TargetServiceStub(channel).GetStats(stats, timeout=5)
                assert info.value.code() == UNAVAILABLE, what
        generate = target_service_pb2.TargetServiceGenerateRequest(
            request_id="direct", prompt="hello", tenant_salt="someone-else",
            sampling=common_pb2.SamplingParams(max_tokens=2))
        for identity in ("gateway", "draft", "cache"):
            async with internal_channel(mesh.target.address, MeshTls.from_dir(certs, identity)) as channel:
                stub = target_service_pb2_grpc.TargetServiceStub(channel)
                for call in (stub.GetStats(stats, timeout=5), _drain(stub.Generate(generate, timeout=5))):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                    assert info.value.code() == UNAUTHENTICATED, identity
        response = await mesh.target_stub().GetStats(stats, timeout=5)  # as the router
        assert response.running_requests == 0
    finally:
        await mesh.stop()
        await draft.stop(0)


async def _drain(call) -> None:
    async for _ in call:
        pass


# ---- services built from settings (what `specmesh serve` runs) ---------------------------

async def test_internal_services_need_certificates_or_explicit_dev_mode():
    with pytest.raises(ValueError) as info:
        build_server("draft", read_settings({}, port=free_port()))
    assert str(info.value) == (
        "internal services need mesh certificates: run `specmesh certs --out DIR` and pass "
        "--tls-dir DIR (or SPECMESH_TLS_DIR), or pass --dev for plaintext on a development machine")
    server = build_server("draft", read_settings({}, dev=True, port=free_port()))
    assert server.config.tls is None
    await server.stop(0)


async def test_router_refuses_the_public_default_salt_secret_outside_dev_mode(certs):
    with pytest.raises(ValueError) as info:
        build_server("router", read_settings({}, tls_dir=str(certs), port=free_port()))
    assert str(info.value) == (
        "salt_secret is the public default: set SPECMESH_SALT_SECRET to a random value "
        "(e.g. `openssl rand -hex 32`), or pass --dev on a development machine")
    own = {"SPECMESH_SALT_SECRET": "s3cret", "SPECMESH_TOKENS": "t0ken=acme"}
    for settings in (read_settings(own, tls_dir=str(certs), port=free_port()),
                     read_settings({}, dev=True, port=free_port())):
        await build_server("router", settings).stop(0)


async def test_router_refuses_the_public_dev_token_outside_dev_mode(certs):
    env = {"SPECMESH_SALT_SECRET": "s3cret"}
    for tokens in ("specmesh-dev-token=default", "t0ken=acme,specmesh-dev-token=default"):
        with pytest.raises(ValueError) as info:
            build_server("router", read_settings({**env, "SPECMESH_TOKENS": tokens},
                                                 tls_dir=str(certs), port=free_port()))
        assert str(info.value) == (
            "tokens accept the public dev token 'specmesh-dev-token': set SPECMESH_TOKENS to your own "
            "TOKEN=TENANT,... pairs, or pass --dev on a development machine")


async def test_draft_built_from_settings_with_a_tls_dir_refuses_plaintext(certs):
    server = build_server("draft", read_settings({}, tls_dir=str(certs), port=free_port()))
    await server.start()
    try:
        # `check` is the blocking healthcheck of compose: off the loop that serves.
        with pytest.raises(grpc.RpcError) as info:
            await asyncio.to_thread(check, server.address, timeout=5)
        assert info.value.code() == UNAVAILABLE
        tls = MeshTls.from_dir(certs, "draft")
        assert await asyncio.to_thread(check, server.address, timeout=5, tls=tls) == "SERVING"
    finally:
        await server.stop(0)


async def test_router_public_port_serves_tls_when_given_a_certificate(certs):
    settings = read_settings({}, dev=True, port=free_port(), public_tls_cert=str(certs / "router.pem"),
                             public_tls_key=str(certs / "router-key.pem"))
    server = build_server("router", settings)
    await server.start()
    try:
        ca = (certs / "ca.pem").read_bytes()
        async with public_channel(server.address, ca) as channel:  # no client certificate
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            # It answers over TLS (NOT_SERVING: no target runs behind this router).
            assert health.status in (health_pb2.HealthCheckResponse.SERVING,
                                     health_pb2.HealthCheckResponse.NOT_SERVING)
        async with public_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert info.value.code() == UNAVAILABLE
    finally:
        await server.stop(0)


# ---- the command line ---------------------------------------------------------------------

def test_certs_command_writes_a_directory_services_start_from(tmp_path, capsys):
    assert main(["certs", "--out", str(tmp_path / "certs"), "--san", "mesh.example"]) == 0
    assert capsys.readouterr().out == (f"mesh certificates for router, target, draft, cache, gateway in "
                                       f"{tmp_path / 'certs'} (start services with --tls-dir "
                                       f"{tmp_path / 'certs'})\n")
    tls = MeshTls.from_dir(tmp_path / "certs", "target")
    sans = x509.load_pem_x509_certificate(tls.cert_pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["target", "localhost", "mesh.example"]


def test_serve_router_refuses_the_default_salt_secret_with_one_line(certs):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_")}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "router", "--port",
                           str(free_port()), "--tls-dir", str(certs)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == (
        "specmesh: error: salt_secret is the public default: set SPECMESH_SALT_SECRET to a random "
        "value (e.g. `openssl rand -hex 32`), or pass --dev on a development machine")
