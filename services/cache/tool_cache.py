"""Tool-result cache with single-flight leases.

A key is (tenant, tool, tool version, canonical JSON of the arguments). On a miss
the first caller takes the *lease* (set-if-absent with expiry in the backend, so one
holder cluster-wide when the backend is Redis) and computes; concurrent callers poll
until the value is stored, or take the lease themselves when the holder's lease
expires without a store. Errors are stored like values, marked, for a short TTL
(negative caching). A new tool version is a new key, so bumping it invalidates.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
import uuid
from dataclasses import dataclass
from urllib.parse import quote

from services.cache.config import CacheConfig

HIT, LEASE_GRANTED, WAITED = "hit", "lease_granted", "waited"
_VALUE, _ERROR = b"v", b"e"
_POLL_FIRST_S, _POLL_MAX_S = 0.005, 0.05
MAX_NAME_BYTES = 256


class InvalidInput(ValueError):
    pass


class LeaseLost(Exception):
    """Another caller holds the lease now."""


class WaitTimeout(Exception):
    pass


@dataclass(frozen=True)
class ToolKey:
    tenant: str
    tool: str
    version: str
    arguments: str  # canonical JSON

    def storage_key(self, namespace: str) -> str:
        digest = hashlib.sha256(self.arguments.encode()).hexdigest()
        return ":".join((namespace, "t", quote(self.tenant, safe=""), "tool", quote(self.tool, safe=""),
                         quote(self.version, safe=""), digest))


@dataclass(frozen=True)
class ToolResult:
    outcome: str  # HIT, LEASE_GRANTED or WAITED
    value: bytes = b""
    error: str | None = None  # a cached error (negative caching)
    lease_id: str = ""


def canonical_arguments(arguments_json: str) -> str:
    """The arguments as one canonical JSON text (sorted keys, no spaces): equal calls, equal
    keys. The router shards tool results across cache instances by the same text.
    Raises ValueError (or RecursionError) when it is not JSON."""
    return json.dumps(json.loads(arguments_json or "null", parse_constant=_no_constant),
                      sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def tool_key(config: CacheConfig, tenant: str, tool: str, version: str, arguments_json: str) -> ToolKey:
    """Validates and canonicalizes; raises InvalidInput naming every problem."""
    problems = []
    for name, value in (("tool", tool), ("tool_version", version)):
        if not value:
            problems.append(f"{name} is empty")
        elif len(value.encode()) > MAX_NAME_BYTES:
            problems.append(f"{name} is above the limit of {MAX_NAME_BYTES} bytes")
    canonical = ""
    if len(arguments_json.encode()) > config.max_arguments_bytes:
        problems.append(f"arguments_json is above the limit of {config.max_arguments_bytes} bytes")
    else:
        try:
            canonical = canonical_arguments(arguments_json)
        except (ValueError, RecursionError) as exc:
            problems.append(f"arguments_json is not JSON: {exc}")
    if problems:
        raise InvalidInput("; ".join(problems))
    return ToolKey(tenant, tool, version, canonical)


class ToolCache:
    def __init__(self, config: CacheConfig, backend) -> None:
        self.config = config
        self.backend = backend
        self.waiting = 0  # lookups now waiting for another caller's lease
        # Wakes this process's waiters at once when a store happens here; waiters on other
        # instances notice by polling the backend.
        self._stored: dict[str, list] = {}  # value key -> [event, waiters in this process]

    async def lookup(self, key: ToolKey, lease_ms: int, wait_seconds: float) -> ToolResult:
        """A stored result, the lease, or (after waiting for the holder) its result."""
        value_key = key.storage_key(self.config.namespace)
        stored = await self.backend.get(value_key)
        if stored is not None:
            return _result(HIT, stored)
        self.waiting += 1
        entry = self._stored.setdefault(value_key, [asyncio.Event(), 0])
        entry[1] += 1
        try:
            return await self._wait_or_lease(value_key, lease_ms, time.monotonic() + wait_seconds,
                                             entry[0])
        finally:
            self.waiting -= 1
            entry[1] -= 1
            if entry[1] == 0 and self._stored.get(value_key) is entry:
                del self._stored[value_key]

    async def _wait_or_lease(self, value_key: str, lease_ms: int, deadline: float,
                             stored_here: asyncio.Event) -> ToolResult:
        poll = _POLL_FIRST_S
        waited = False
        while True:
            lease_id = uuid.uuid4().hex
            if await self.backend.set_nx(value_key + ":lease", lease_id.encode(), lease_ms):
                stored = await self.backend.get(value_key)  # stored between our get and set_nx?
                if stored is None:
                    return ToolResult(LEASE_GRANTED, lease_id=lease_id)
                await self.backend.delete_if_equals(value_key + ":lease", lease_id.encode())
                return _result(WAITED if waited else HIT, stored)
            waited = True
            if time.monotonic() + poll > deadline:
                raise WaitTimeout("the deadline passed while waiting for another caller's tool result")
            try:
                await asyncio.wait_for(stored_here.wait(), poll)
            except asyncio.TimeoutError:
                pass
            poll = min(poll * 2, _POLL_MAX_S)
            stored = await self.backend.get(value_key)
            if stored is not None:
                return _result(WAITED, stored)

    async def store(self, key: ToolKey, lease_id: str, value: bytes | None, error: str | None,
                    ttl_seconds: int) -> None:
        """Stores a value (or an error, for at most the negative TTL) and releases the lease."""
        value_key = key.storage_key(self.config.namespace)
        holder = await self.backend.get(value_key + ":lease")
        if holder is not None and holder != lease_id.encode():
            raise LeaseLost("another caller holds the lease for this tool result now "
                            "(this caller's lease expired)")
        if error is not None:
            payload = _ERROR + error.encode()
            ttl_seconds = min(ttl_seconds, self.config.tool_error_ttl_seconds)
        else:
            payload = _VALUE + value
        await self.backend.set(value_key, payload, ttl_seconds * 1000)
        if lease_id:
            await self.backend.delete_if_equals(value_key + ":lease", lease_id.encode())
        entry = self._stored.pop(value_key, None)
        if entry is not None:
            entry[0].set()


def _result(outcome: str, stored: bytes) -> ToolResult:
    if stored[:1] == _ERROR:
        return ToolResult(outcome, error=stored[1:].decode(errors="replace"))
    return ToolResult(outcome, value=stored[1:])


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def lease_ms_of(config: CacheConfig, requested: int) -> int:
    if requested == 0:
        return config.tool_lease_ms
    if not 0 < requested <= config.max_lease_ms:
        raise InvalidInput(f"lease_ms {requested} is out of range [1, {config.max_lease_ms}]")
    return requested


def wait_seconds_of(config: CacheConfig, time_remaining: float | None) -> float:
    if time_remaining is None or not math.isfinite(time_remaining):
        return config.max_wait_seconds
    return max(0.0, min(time_remaining, config.max_wait_seconds))
