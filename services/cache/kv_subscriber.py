"""Follows every target replica's KV events into the prefix index.

One task per replica. Each (re)connection asks for a snapshot first, so the index
equals the replica's real contents after a start, a reconnect (the target may have
restarted with new sequence numbers) or a gap. A gap is seen two ways: the target
sends a snapshot by itself when our position fell out of its log, or an event's
sequence number is not the next one; then we resubscribe asking for a snapshot.

Replica entries `dns:///NAME:PORT` (a headless Service) are re-resolved every
`resolve_seconds` the same way the router does (services/common/dns_replicas.py), so the
index keys each pod by the same identity the router asks about: a new pod is followed, a
pod gone from DNS is dropped with what it held.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.cache.prefix_index import DEVICE, HOST, REMOVED, SHARED, STORED, PrefixIndex
from services.common.dns_replicas import DnsReplicas
from specmesh.proto.v1 import target_service_pb2, target_service_pb2_grpc
from services.common.tls import MeshTls, internal_channel

log = logging.getLogger(__name__)
RESOLVE_SECONDS = 2.0  # dns:/// entries: re-resolution period (the router's poll is 1 s in deploy/k8s)
_KINDS = {target_service_pb2.KV_EVENT_KIND_BLOCK_STORED: STORED,
          target_service_pb2.KV_EVENT_KIND_BLOCK_REMOVED: REMOVED}
_TIERS = {target_service_pb2.KV_TIER_UNSPECIFIED: DEVICE,  # a target from before tiers
          target_service_pb2.KV_TIER_DEVICE: DEVICE, target_service_pb2.KV_TIER_HOST: HOST,
          target_service_pb2.KV_TIER_SHARED: SHARED}


class _Gap(Exception):
    pass


class KVSubscribers:
    """Keeps `index` in step with its replicas until `stop()`."""

    def __init__(self, index: PrefixIndex, tls: MeshTls | None = None, retry_seconds: float = 0.5,
                 max_retry_seconds: float = 5.0, entries: tuple[str, ...] = (),
                 resolve_seconds: float = RESOLVE_SECONDS) -> None:
        """`entries`: dns:/// replica entries to follow besides `index.replicas`."""
        self.index = index
        self.dns = DnsReplicas(entries)
        self.resolve_seconds = resolve_seconds
        self.tls = tls
        self.retry_seconds = retry_seconds
        self.max_retry_seconds = max_retry_seconds
        self.gaps = 0  # client-side sequence gaps seen
        self._tasks: dict[str, asyncio.Task] = {}  # replica -> its follower
        self._listed: tuple[str, ...] = ()
        self._resolver: asyncio.Task | None = None

    def start(self) -> None:
        self._listed = self.index.replicas
        for replica in self._listed:
            self._start_following(replica)
        if self.dns.dynamic:
            self._resolver = asyncio.create_task(self._resolve_forever(), name="kv-events dns")

    async def stop(self) -> None:
        tasks = [*self._tasks.values(), *([self._resolver] if self._resolver else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._resolver = {}, None

    async def resolve_once(self) -> None:
        """Follows the replicas DNS names now; drops those it no longer names."""
        added, removed = await self.dns.changes(self._tasks.keys())
        for replica in added:
            log.info("prefix index: following %s (found by DNS)", replica)
            self.index.track(replica)
            self._start_following(replica)
        gone = [(r, self._tasks.pop(r)) for r in removed if r not in self._listed]
        for replica, task in gone:
            log.info("prefix index: %s left DNS", replica)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.index.drop(replica)

    # ---- helpers ------------------------------------------------------------------------

    def _start_following(self, replica: str) -> None:
        self._tasks[replica] = asyncio.create_task(self._follow(replica), name=f"kv-events {replica}")

    async def _resolve_forever(self) -> None:
        while True:
            try:
                await self.resolve_once()
            except Exception:  # never let the resolver die
                log.exception("prefix index: replica resolution failed")
            await asyncio.sleep(self.resolve_seconds)

    async def _follow(self, replica: str) -> None:
        delay = self.retry_seconds
        while True:
            channel = internal_channel(replica, self.tls)
            try:
                stub = target_service_pb2_grpc.TargetServiceStub(channel)
                while True:  # one subscription per loop; a gap restarts it with a snapshot
                    try:
                        await self._subscribe(stub, replica)
                        break  # the target ended the stream (stopping): reconnect
                    except _Gap:
                        self.gaps += 1
                        log.info("KV event gap from %s: resyncing by snapshot", replica)
                delay = self.retry_seconds
            except grpc.aio.AioRpcError as exc:
                log.debug("KV events from %s: %s", replica, exc.code().name)
            finally:
                self.index.forget(replica)
                await channel.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_retry_seconds)

    async def _subscribe(self, stub, replica: str) -> None:
        last = None  # sequence of the last applied event (None until the snapshot)
        call = stub.SubscribeKVEvents(target_service_pb2.SubscribeKVEventsRequest(snapshot=True))
        try:
            async for message in call:
                if message.is_snapshot:
                    self.index.apply_snapshot(replica, ((b.block_hash, _TIERS.get(b.tier, DEVICE))
                                                        for b in message.snapshot_blocks))
                    last = message.snapshot_sequence
                    continue
                for event in message.events:
                    if last is None or event.sequence > last + 1:
                        raise _Gap()
                    if event.sequence <= last:
                        continue  # already in the snapshot
                    tier = _TIERS.get(event.tier)
                    if tier is not None:  # a tier newer than this index: skipped
                        self.index.apply_event(replica, _KINDS[event.kind], event.block_hash, tier)
                    last = event.sequence
        finally:
            call.cancel()
