"""Service credentials: mutual TLS between the mesh's services.

Every internal service (target, draft, cache) serves only TLS that requires a client
certificate signed by the mesh CA, and an interceptor then checks that the peer's
certificate names a service allowed to call the method (`ALLOWED_CALLERS`):

  no TLS, TLS without a client certificate, a certificate of another CA
      -> the handshake fails; the caller sees UNAVAILABLE and no handler runs
  a mesh certificate of a service not allowed here (e.g. the router calling the draft)
      -> UNAUTHENTICATED
  health and reflection -> any mesh certificate

A service's identity is its certificate's subject common name ("router", "target", ...).
Callers build every internal channel with `internal_channel` / `internal_sync_channel`,
which use the mesh credentials when given and plaintext otherwise (explicit dev mode).
The router's public port is separate: TLS with its own certificate when configured
(`PublicTls`), no client certificate, bearer tokens as before.

`make_dev_certs` writes a development CA and per-service certificates (`specmesh certs`).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

SERVICE_IDENTITIES = ("router", "target", "draft", "cache", "gateway")
CA_FILE = "ca.pem"

# Who may call what: method-path prefix -> service identities (longest prefix wins).
# Methods of a secured server that match no prefix are refused; health and reflection
# (`_OPEN_PREFIXES`) accept any mesh certificate.
ALLOWED_CALLERS: Mapping[str, frozenset[str]] = {
    "/specmesh.v1.TargetService/": frozenset({"router"}),
    "/specmesh.v1.TargetService/SubscribeKVEvents": frozenset({"router", "cache"}),  # prefix index
    "/specmesh.v1.DraftService/": frozenset({"target"}),
    "/specmesh.v1.CacheService/": frozenset({"router"}),
}
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


# ---- credentials --------------------------------------------------------------
@dataclass(frozen=True)
class MeshTls:
    """One service's mesh identity: the CA it trusts and its own certificate and key (PEM)."""

    identity: str
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    @classmethod
    def from_files(cls, identity: str, ca: str | Path, cert: str | Path, key: str | Path) -> "MeshTls":
        paths = {"CA": Path(ca).expanduser(), "certificate": Path(cert).expanduser(),
                 "key": Path(key).expanduser()}
        for what, path in paths.items():
            if not path.is_file():
                raise FileNotFoundError(f"mesh TLS {what} {path} does not exist "
                                        f"(make development certificates with `specmesh certs --out DIR`)")
        return cls(identity, paths["CA"].read_bytes(), paths["certificate"].read_bytes(),
                   paths["key"].read_bytes())

    @classmethod
    def from_dir(cls, directory: str | Path, identity: str) -> "MeshTls":
        """Reads `ca.pem`, `<identity>.pem` and `<identity>-key.pem` (the layout `specmesh certs` writes)."""
        directory = Path(directory).expanduser()
        return cls.from_files(identity, directory / CA_FILE, directory / f"{identity}.pem",
                              directory / f"{identity}-key.pem")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: verify the server against the mesh CA and present our certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def server_tls(self) -> "ServerTls":
        """Server side: require a client certificate of the mesh CA, callers per ALLOWED_CALLERS."""
        return ServerTls(self.cert_pem, self.key_pem, client_ca_pem=self.ca_pem)


def load_mesh_tls(settings, identity: str) -> MeshTls | None:
    """`identity`'s mesh credentials from Settings (tls_dir, or tls_ca/tls_cert/tls_key);
    None (plaintext) only in dev mode. Raises ValueError saying what to do otherwise."""
    if settings.tls_dir or settings.tls_ca or settings.tls_cert or settings.tls_key:
        directory = Path(settings.tls_dir) if settings.tls_dir else None
        paths = []
        for value, default in ((settings.tls_ca, CA_FILE), (settings.tls_cert, f"{identity}.pem"),
                               (settings.tls_key, f"{identity}-key.pem")):
            if not value and directory is None:
                raise ValueError("tls_ca, tls_cert and tls_key go together (or give tls_dir)")
            paths.append(value or directory / default)
        return MeshTls.from_files(identity, *paths)
    if settings.dev:
        return None
    raise ValueError("internal services need mesh certificates: run `specmesh certs --out DIR` and "
                     "pass --tls-dir DIR (or SPECMESH_TLS_DIR), or pass --dev for plaintext on a "
                     "development machine")


@dataclass(frozen=True)
class PublicTls:
    """The router's public port: server certificate and key, no client certificate."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path) -> "PublicTls":
        cert, key = Path(cert).expanduser(), Path(key).expanduser()
        for path in (cert, key):
            if not path.is_file():
                raise FileNotFoundError(f"public TLS file {path} does not exist")
        return cls(cert.read_bytes(), key.read_bytes())

    def server_tls(self) -> "ServerTls":
        return ServerTls(self.cert_pem, self.key_pem)


@dataclass(frozen=True)
class ServerTls:
    """How a server's port is secured. With `client_ca_pem` it is mutual TLS: a client
    certificate of that CA is required and `allowed_callers` decides per method."""

    cert_pem: bytes
    key_pem: bytes = field(repr=False)
    client_ca_pem: bytes | None = None
    allowed_callers: Mapping[str, frozenset[str]] = field(default_factory=lambda: ALLOWED_CALLERS)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.client_ca_pem,
            require_client_auth=self.client_ca_pem is not None)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [PeerIdentityInterceptor(self.allowed_callers)] if self.client_ca_pem else []


# ---- channels -----------------------------------------------------------------
def internal_channel(address: str, tls: MeshTls | None, options=None) -> grpc.aio.Channel:
    """An asyncio channel to an internal service: mutual TLS with `tls`, plaintext when None
    (dev mode), tracing interceptors either way."""
    from services.common.telemetry import client_interceptors
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=client_interceptors())
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options,
                                   interceptors=client_interceptors())


def internal_sync_channel(address: str, tls: MeshTls | None, options=None) -> grpc.Channel:
    """The blocking-API twin of `internal_channel` (the target's draft client thread)."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def public_channel(address: str, ca_pem: bytes | None = None) -> grpc.aio.Channel:
    """A client channel to the router's public port: TLS verified with `ca_pem` when given."""
    if ca_pem is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca_pem))


# ---- server-side identity check -----------------------------------------------
def peer_identity(context) -> str | None:
    """The calling service's identity (its certificate's common name), None without one."""
    auth = context.auth_context() or {}
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    names = auth.get("x509_common_name") or []
    return names[0].decode() if len(names) == 1 else None


def allowed_for(method: str, allowed_callers: Mapping[str, frozenset[str]]) -> frozenset[str] | None:
    """Identities allowed to call `method`; None = any mesh certificate (health, reflection)."""
    if method.startswith(_OPEN_PREFIXES):
        return None
    best = max((p for p in allowed_callers if method.startswith(p)), key=len, default=None)
    return allowed_callers[best] if best is not None else frozenset()


class PeerIdentityInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED unless the peer's mesh certificate names an allowed service."""

    def __init__(self, allowed_callers: Mapping[str, frozenset[str]]) -> None:
        self._allowed = allowed_callers

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        allowed = allowed_for(method, self._allowed)
        return _guarded(handler, lambda context: _check(context, method, allowed))


async def _check(context, method: str, allowed: frozenset[str] | None) -> None:
    identity = peer_identity(context)
    if identity is None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "internal service: a mesh client certificate is required")
    if allowed is not None and identity not in allowed:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"service {identity!r} may not call {method}")


def _guarded(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    """The same handler with `check(context)` awaited before the behaviour runs."""
    if handler.unary_unary:
        async def unary_unary(request, context):
            await check(context)
            return await handler.unary_unary(request, context)
        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer)
    if handler.stream_unary:
        async def stream_unary(requests, context):
            await check(context)
            return await handler.stream_unary(requests, context)
        return grpc.stream_unary_rpc_method_handler(
            stream_unary, handler.request_deserializer, handler.response_serializer)
    behaviour = handler.unary_stream or handler.stream_stream

    async def streaming(request_or_iterator, context):
        await check(context)
        result = behaviour(request_or_iterator, context)
        if hasattr(result, "__aiter__"):
            async for response in result:
                yield response
        else:  # a coroutine that writes with context.write
            await result
    factory = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
               else grpc.stream_stream_rpc_method_handler)
    return factory(streaming, handler.request_deserializer, handler.response_serializer)


# ---- development certificates ------------------------------------------------
def make_dev_certs(out: str | Path, services: Iterable[str] = SERVICE_IDENTITIES,
                   hosts: Iterable[str] = (), days: int = 365, force: bool = False) -> Path:
    """Writes a development CA (`ca.pem`) and, per service, `<name>.pem` and `<name>-key.pem`
    into `out`. Each certificate's common name is the service name; its subject alternative
    names are the service name (compose), localhost, 127.0.0.1, ::1 and `hosts` (DNS names,
    wildcards or IP addresses; "SERVICE=HOST" adds HOST to that service's certificate only);
    it serves and calls (server and client auth). The CA key is not kept: make new
    certificates with a new CA instead of adding to an old one. Existing files are kept
    unless `force`."""
    out = Path(out).expanduser()
    services = list(services)
    extra: dict[str, list[str]] = {name: [] for name in services}
    for host in hosts:
        service, sep, name = host.partition("=")
        if sep and service not in extra:
            raise ValueError(f"{host!r}: {service!r} is not one of {', '.join(services)}")
        for s in ([service] if sep else services):
            extra[s].append(name if sep else host)
    wanted = [out / CA_FILE] + [out / f"{s}{suffix}" for s in services for suffix in (".pem", "-key.pem")]
    if not force and all(p.is_file() for p in wanted):
        return out
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _make_ca(days)
    _write(out / CA_FILE, _pem_cert(ca_cert), private=False)
    for name in services:
        key, cert = _make_leaf(name, [name, "localhost", *extra[name]], ca_key, ca_cert, days)
        _write(out / f"{name}.pem", _pem_cert(cert), private=False)
        _write(out / f"{name}-key.pem", _pem_key(key), private=True)
    return out


def _make_ca(days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specmesh development CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def _make_leaf(name: str, hosts: list[str], ca_key, ca_cert, days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                    x509.IPAddress(ipaddress.ip_address("::1"))]
    for host in hosts:
        try:
            general: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            general = x509.DNSName(host)
        if general not in sans:
            sans.append(general)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool) -> None:
    """Private keys are 0600; certificates 0644 (containers read them as another user)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600 if private else 0o644)
