"""Caller authentication: bearer token in metadata -> tenant -> tenant salt."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence


class Unauthenticated(Exception):
    pass


class TenantAuth:
    def __init__(self, tokens: dict[str, str], salt_secret: str) -> None:
        self._tokens = dict(tokens)
        self._secret = salt_secret.encode()

    def tenant(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
        """Returns the tenant of the caller's `authorization: Bearer <token>` header."""
        headers = [v for k, v in metadata or () if k.lower() == "authorization"]
        if not headers:
            raise Unauthenticated("missing credential: send metadata 'authorization: Bearer <token>'")
        if len(headers) > 1:  # which one wins would differ between proxies: refuse, never guess
            raise Unauthenticated(f"{len(headers)} authorization headers: send exactly one")
        header = headers[0]
        if isinstance(header, bytes):
            header = header.decode(errors="replace")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("malformed credential: expected 'authorization: Bearer <token>'")
        for known, tenant in self._tokens.items():
            if hmac.compare_digest(known.encode(), token.strip().encode()):
                return tenant
        raise Unauthenticated("unknown credential")

    def salt(self, tenant: str) -> str:
        """A stable per-tenant salt for the prefix cache; reveals nothing about the tenant."""
        return hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]
