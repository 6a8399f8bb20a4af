"""Replica entries found by DNS rather than listed: `dns:///NAME:PORT`.

`NAME` (e.g. a Kubernetes headless Service) is resolved; each address it answers is one
replica. A replica's identity is `HOST:PORT`, where HOST is the address's reverse name when
that name resolves back to that address alone (a StatefulSet pod's own DNS name,
`specmesh-target-0.specmesh-target.NS.svc.cluster.local`, or a hosts-file name), else the
address itself (`10.0.0.7:50052`, `[fd00::7]:50052`). The identity is used everywhere a
replica is named: the router's replica key and route record, the prefix index's replica key,
and the channel target. A channel to the pod's name verifies the mesh certificate against
that name (the TLS server name is the channel's authority) — so certificates issued for DNS
names (`--san 'target=*.specmesh-target.NS.svc.cluster.local'`) verify, and the router and the
cache name the same pod the same way.

Entries without the prefix are passed through as they are (listed replicas).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Collection, Iterable

from services.common.mesh_config import DNS_PREFIX

log = logging.getLogger(__name__)


def split_dns_entry(entry: str) -> tuple[str, int]:
    """`dns:///NAME:PORT` -> (NAME, PORT); ValueError when it is not of that form."""
    if not entry.startswith(DNS_PREFIX):
        raise ValueError(f"{entry!r} is not {DNS_PREFIX}NAME:PORT")
    host, sep, port = entry[len(DNS_PREFIX):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r} is not {DNS_PREFIX}NAME:PORT")
    return host, int(port)


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class DnsReplicas:
    """Expands a list of replica entries to replica identities, on each `expand()`.

    A `dns:///` entry that does not resolve right now (pods starting, DNS down) keeps the
    identities it last resolved to: a resolver hiccup never empties a pool; an address that
    is gone from a good answer is gone from the result.
    """

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries = tuple(entries)
        for entry in self.entries:
            if entry.startswith(DNS_PREFIX):
                split_dns_entry(entry)
        self._last: dict[str, list[str]] = {e: [] for e in self.entries if e.startswith(DNS_PREFIX)}
        self._names: dict[str, str | None] = {}  # address -> its reverse name (None: none)
        self._seen: set[str] = set()  # addresses answered during this expand()
        self._lock = asyncio.Lock()  # a poll and a failure may resolve at once

    @property
    def dynamic(self) -> bool:
        return bool(self._last)

    def listed(self) -> list[str]:
        """The entries that need no resolution."""
        return [e for e in self.entries if not e.startswith(DNS_PREFIX)]

    async def changes(self, known: Collection[str]) -> tuple[list[str], list[str]]:
        """Resolves now: (identities to add, identities to drop) against `known`, the caller's
        current set (a live view, read once the resolution is done). ([], []) when no entry
        is dynamic. One resolution at a time; the caller applies both lists before its next
        await, so a resolution that follows sees them applied."""
        if not self.dynamic:
            return [], []
        async with self._lock:
            wanted = await self.expand()
            return [i for i in wanted if i not in known], [i for i in known if i not in wanted]

    async def expand(self) -> list[str]:
        """Every replica identity, listed entries first, without duplicates."""
        out = self.listed()
        for entry in self._last:
            try:
                self._last[entry] = await self._resolve(entry)
            except OSError as exc:
                log.info("replicas %s not resolvable now (%s): keeping %d", entry, exc, len(self._last[entry]))
            out.extend(self._last[entry])
        for address in [a for a in self._names if a not in self._seen]:
            del self._names[address]  # gone from every answer: its name is not kept forever
        self._seen.clear()
        return list(dict.fromkeys(out))

    async def _resolve(self, entry: str) -> list[str]:
        host, port = split_dns_entry(entry)
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        self._seen.update(addresses)
        names = await asyncio.gather(*(self._name_of(address) for address in addresses))
        return [host_port(name or address, port) for address, name in zip(addresses, names)]

    async def _name_of(self, address: str) -> str | None:
        """The address's reverse name if it resolves back to the address (else None). The
        reverse answer is kept per address (a pod keeps its name while it keeps its address);
        the forward check is redone each time so a reused address is not misnamed."""
        loop = asyncio.get_running_loop()
        if address not in self._names:
            try:
                name, _, _ = await loop.run_in_executor(None, socket.gethostbyaddr, address)
            except OSError:
                name = None
            self._names[address] = name
        name = self._names[address]
        if name is None:
            return None
        try:
            infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError:
            infos = []
        forward = {info[4][0] for info in infos}
        if address not in forward:
            del self._names[address]  # stale: look it up again next time
            return None
        if forward != {address}:  # a name of several (the Service's own): not this pod's
            return None
        return name
