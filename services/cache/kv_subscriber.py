"""Follows every target replica's KV events into the prefix index.

One task per replica. Each (re)connection asks for a snapshot first, so the index
equals the replica's real contents after a start, a reconnect (the target may have
restarted with new sequence numbers) or a gap. A gap is seen two ways: the target
sends a snapshot by itself when our position fell out of its log, or an event's
sequence number is not the next one; then we resubscribe asking for a snapshot.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.cache.prefix_index import REMOVED, STORED, PrefixIndex
from specmesh.proto.v1 import target_service_pb2, target_service_pb2_grpc
from services.common.tls import MeshTls, internal_channel

log = logging.getLogger(__name__)
_KINDS = {target_service_pb2.KV_EVENT_KIND_BLOCK_STORED: STORED,
          target_service_pb2.KV_EVENT_KIND_BLOCK_REMOVED: REMOVED}


class _Gap(Exception):
    pass


class KVSubscribers:
    """Keeps `index` in step with its replicas until `stop()`."""

    def __init__(self, index: PrefixIndex, tls: MeshTls | None = None, retry_seconds: float = 0.5,
                 max_retry_seconds: float = 5.0) -> None:
        self.index = index
        self.tls = tls
        self.retry_seconds = retry_seconds
        self.max_retry_seconds = max_retry_seconds
        self.gaps = 0  # client-side sequence gaps seen
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow(r), name=f"kv-events {r}")
                       for r in self.index.replicas]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # ---- helpers ------------------------------------------------------------------------

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
                    self.index.apply_snapshot(replica, (b.block_hash for b in message.snapshot_blocks))
                    last = message.snapshot_sequence
                    continue
                for event in message.events:
                    if last is None or event.sequence > last + 1:
                        raise _Gap()
                    if event.sequence <= last:
                        continue  # already in the snapshot
                    self.index.apply_event(replica, _KINDS[event.kind], event.block_hash)
                    last = event.sequence
        finally:
            call.cancel()
