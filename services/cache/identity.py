"""Who is calling the cache service: the tenant and access labels the router vouches for.

The router authenticates the end caller and passes the result in metadata on its
internal (mutually authenticated) call; no request field ever names a tenant.
`caller_metadata` writes the two keys (router side), `caller_from_metadata` reads them
(cache side). Labels are a comma-separated set; order and repeats do not matter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TENANT_KEY = "specmesh-tenant"
LABELS_KEY = "specmesh-labels"
MAX_TENANT_BYTES = 256
MAX_LABELS = 64


class MissingIdentity(Exception):
    """No (valid) tenant in the call's metadata."""


@dataclass(frozen=True)
class Caller:
    tenant: str
    labels: frozenset[str]

    def may_read(self, document_labels: Iterable[str]) -> bool:
        """A caller reads a document when it holds every one of the document's labels."""
        return self.labels.issuperset(document_labels)

    @property
    def label_key(self) -> str:
        """The label set in one canonical string (for cache keys)."""
        return ",".join(sorted(self.labels))


def caller_metadata(tenant: str, labels: Iterable[str] = ()) -> tuple[tuple[str, str], ...]:
    return ((TENANT_KEY, tenant), (LABELS_KEY, ",".join(sorted(set(labels)))))


def caller_from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> Caller:
    tenants = [_text(v) for k, v in metadata or () if k.lower() == TENANT_KEY]
    if len(tenants) != 1 or not tenants[0] or len(tenants[0].encode()) > MAX_TENANT_BYTES:
        raise MissingIdentity(f"expected exactly one non-empty '{TENANT_KEY}' metadata entry "
                              "(set by the router after authenticating the caller)")
    raw = ",".join(_text(v) for k, v in metadata or () if k.lower() == LABELS_KEY)
    labels = frozenset(filter(None, (part.strip() for part in raw.split(","))))
    if len(labels) > MAX_LABELS:
        raise MissingIdentity(f"more than {MAX_LABELS} access labels")
    return Caller(tenants[0], labels)


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
