"""The cache service's prefix index against two real tiny-model target replicas over gRPC."""

from __future__ import annotations

import asyncio
from collections import deque

import grpc
import pytest

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.cache.prefix_index import PrefixIndex
from services.common.block_hash import chained_block_hashes, extra_key
from specmesh.proto.v1 import cache_service_pb2 as pb
from specmesh.proto.v1 import (
    cache_service_pb2_grpc,
    common_pb2,
    target_service_pb2,
    target_service_pb2_grpc,
)
from services.common.server import GrpcServer, ServerConfig
from services.common.tls import MeshTls, internal_channel, make_dev_certs
from services.target.server.app import build_target_server
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from tests.target.shared_redis import URL, kv_prefix  # noqa: F401 (fixture)

SALT = "salt-a"


class Replica:
    def __init__(self, model_dir, num_blocks: int, certs=None, **config) -> None:
        self.engine = Engine.load(EngineConfig(
            model_dir=model_dir, dtype="float32", num_blocks=num_blocks, block_size=4,
            max_batched_tokens=64, max_tokens_limit=64, kernels="reference", **config))
        self.certs = certs  # mesh certificates: the target serves mutual TLS, we call as the router
        tls = MeshTls.from_dir(certs, "target").server_tls() if certs else None
        self.server = build_target_server(ServerConfig(port=0, tls=tls), self.engine, "tiny")
        self.channel = None

    async def start(self) -> None:
        await self.server.start()
        self.channel = internal_channel(self.server.address,
                                        MeshTls.from_dir(self.certs, "router") if self.certs else None)

    async def generate(self, prompt: str, max_tokens: int = 3) -> None:
        stub = target_service_pb2_grpc.TargetServiceStub(self.channel)
        request = target_service_pb2.TargetServiceGenerateRequest(
            prompt=prompt, tenant_salt=SALT, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
        async for _ in stub.Generate(request):
            pass

    def cached(self, tier: str = "device") -> set[int]:
        return {b.block_hash for b in self.engine.kv_snapshot()[1] if b.tier == tier}

    def hashes(self, prompt: str) -> list[int]:
        return chained_block_hashes(self.engine.tokenize(prompt), 4, extra_key(self.engine.name, SALT))

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(0)


@pytest.fixture
async def replicas(tiny_llama_dir):
    pair = [Replica(tiny_llama_dir, 24), Replica(tiny_llama_dir, 64)]
    for r in pair:
        await r.start()
    yield pair
    for r in pair:
        await r.stop()


async def start_cache(replicas) -> GrpcServer:
    server = build_cache_server(CacheConfig(replicas=tuple(r.server.address for r in replicas)))
    await server.start()
    return server


async def until_index_equals(index: PrefixIndex, replicas) -> None:
    """Waits (bounded) until the index holds exactly each replica's cached blocks."""
    for _ in range(250):
        if all(index.is_synced(r.server.address) and index.blocks(r.server.address) == r.cached()
               for r in replicas):
            return
        await asyncio.sleep(0.02)
    assert [index.blocks(r.server.address) for r in replicas] == [r.cached() for r in replicas]


async def test_stored_and_removed_blocks_follow_both_replicas(replicas):
    a, b = replicas
    cache = await start_cache(replicas)
    index = cache.service.index
    try:
        await until_index_equals(index, replicas)
        prompt_a, prompt_b = "the quick brown fox jumps over the lazy dog", "a b c d e f g h i j k l"
        await a.generate(prompt_a)
        await b.generate(prompt_b)
        await until_index_equals(index, replicas)
        hashes = a.hashes(prompt_a)
        assert len(hashes) >= 2 and a.cached().issuperset(hashes)
        async with grpc.aio.insecure_channel(cache.address) as channel:
            stub = cache_service_pb2_grpc.CacheServiceStub(channel)
            reply = await stub.PrefixMatch(pb.PrefixMatchRequest(block_hashes=hashes + [12345]))
            assert [(m.replica, m.matched_blocks, m.synced) for m in reply.matches] == [
                (a.server.address, len(hashes), True), (b.server.address, 0, True)]
            only_b = await stub.PrefixMatch(pb.PrefixMatchRequest(
                block_hashes=b.hashes(prompt_b), replicas=[b.server.address, "unknown:1"]))
            assert [(m.matched_blocks, m.synced) for m in only_b.matches] == [
                (len(b.hashes(prompt_b)), True), (0, False)]
        # Replica a has 24 blocks: other prompts evict prompt_a's blocks; the index drops them.
        for i in range(6):
            await a.generate(f"{i} other words to fill the pool of the first replica", 2)
        await until_index_equals(index, replicas)
        assert not a.cached().issuperset(hashes) and a.engine.stats().evictions > 0
        assert index.events_applied > 0
    finally:
        await cache.stop(0)


async def test_gap_and_restart_resync_to_real_contents(replicas):
    a, b = replicas
    cache = await start_cache(replicas)
    index = cache.service.index
    try:
        await until_index_equals(index, replicas)
        resyncs = index.resyncs
        # A log that keeps 2 events: one prefill of many blocks overflows it before the
        # subscriber reads, so the target sends a snapshot (a gap seen by the target).
        a.engine.kv_events._events = deque(a.engine.kv_events._events, maxlen=2)
        await a.generate("one two three four five six seven eight nine ten eleven twelve thirteen")
        await until_index_equals(index, replicas)
        assert index.resyncs > resyncs
    finally:
        await cache.stop(0)
    # While no cache service runs, the replicas change; a new one starts from snapshots.
    await b.generate("changes made while the cache service was down")
    cache = await start_cache(replicas)
    try:
        await until_index_equals(cache.service.index, replicas)
        assert cache.service.index.size == len(a.cached()) + len(b.cached()) > 0
    finally:
        await cache.stop(0)


async def test_index_follows_a_target_over_mutual_tls(tiny_llama_dir, tmp_path):
    """Targets serve mutual TLS: the cache subscribes with its own mesh certificate."""
    certs = make_dev_certs(tmp_path)
    replica = Replica(tiny_llama_dir, 32, certs)
    await replica.start()
    cache = build_cache_server(CacheConfig(replicas=(replica.server.address,),
                                           mesh_tls=MeshTls.from_dir(certs, "cache")))
    await cache.start()
    try:
        await replica.generate("the quick brown fox jumps over the lazy dog")
        await until_index_equals(cache.service.index, [replica])
        assert cache.service.index.size == len(replica.cached()) > 0
    finally:
        await cache.stop(0)
        await replica.stop()


class _JumpyTarget(target_service_pb2_grpc.TargetServiceServicer):
    """A fake target whose event stream skips sequence 7 on the first subscription."""

    def __init__(self) -> None:
        self.requests = []

    async def SubscribeKVEvents(self, request, context):
        self.requests.append((request.after_sequence, request.snapshot))
        first = len(self.requests) == 1
        blocks = [1, 2] if first else [1, 2, 3, 4]
        yield target_service_pb2.SubscribeKVEventsResponse(
            is_snapshot=True, snapshot_sequence=5,
            snapshot_blocks=[target_service_pb2.KVEvent(block_hash=h) for h in blocks])
        stored = target_service_pb2.KV_EVENT_KIND_BLOCK_STORED
        if first:
            yield target_service_pb2.SubscribeKVEventsResponse(events=[
                target_service_pb2.KVEvent(sequence=6, kind=stored, block_hash=3),
                target_service_pb2.KVEvent(sequence=8, kind=stored, block_hash=99)])
        await asyncio.Event().wait()


async def test_sequence_gap_seen_by_the_cache_resubscribes_with_snapshot():
    fake = _JumpyTarget()
    target = GrpcServer(ServerConfig(port=0),
                        lambda s: target_service_pb2_grpc.add_TargetServiceServicer_to_server(fake, s),
                        ["specmesh.v1.TargetService"])
    await target.start()
    cache = await start_cache([type("R", (), {"server": target})()])
    try:
        index = cache.service.index
        for _ in range(250):
            if len(fake.requests) == 2 and index.blocks(target.address) == {1, 2, 3, 4}:
                break
            await asyncio.sleep(0.02)
        assert index.blocks(target.address) == {1, 2, 3, 4}  # 99 (after the gap) never applied
        assert fake.requests == [(0, True), (0, True)]
        assert cache.service.subscribers.gaps == 1 and index.resyncs == 2
    finally:
        await cache.stop(0)
        await target.stop(0)


def test_match_counts_leading_blocks_only():
    index = PrefixIndex(["r1", "r2"])
    index.apply_snapshot("r1", [10, 11, 13])
    assert [(m.matched_blocks, m.synced) for m in index.match([10, 11, 12, 13])] == [(2, True), (0, False)]
    index.apply_event("r1", "removed", 10)
    index.apply_snapshot("r2", [10])
    assert [m.matched_blocks for m in index.match([10, 11])] == [0, 1]
    index.forget("r2")
    assert index.match([10], ["r2"])[0].synced is False
    with pytest.raises(ValueError):
        PrefixIndex(["r1", "r1"])


def test_tracked_replicas_join_unsynced_and_dropped_ones_take_their_blocks():
    index = PrefixIndex(["a:1"])
    index.track("pod-0.svc:1")
    assert index.replicas == ("a:1", "pod-0.svc:1") and not index.is_synced("pod-0.svc:1")
    index.apply_snapshot("pod-0.svc:1", [7, 8])
    assert [m.matched_blocks for m in index.match([7, 8])] == [0, 2]
    index.drop("pod-0.svc:1")
    index.forget("pod-0.svc:1")  # its follower's last word after the drop: no effect
    assert index.replicas == ("a:1",) and index.size == 0
    assert index.match([7], ["pod-0.svc:1"])[0].synced is False


def test_match_follows_the_tiers_in_the_targets_order():
    index = PrefixIndex(["r1", "r2"])
    # r1: blocks 1-2 in its pool, 3-4 in its host tier; 5-6 written to the shared tier by r2.
    index.apply_snapshot("r1", [1, 2, (3, "host"), (4, "host"), (6, "host")])
    index.apply_snapshot("r2", [(5, "shared"), (6, "shared"), (9, "device")])
    matches = index.match([1, 2, 3, 4, 5, 6, 7])
    assert [(m.matched_blocks, m.host_blocks, m.shared_blocks) for m in matches] == [(2, 2, 2), (0, 0, 0)]
    assert [(m.matched_blocks, m.host_blocks, m.shared_blocks) for m in index.match([5, 6])] == [(0, 0, 2), (0, 0, 2)]
    index.apply_event("r1", "stored", 3)  # restored into the pool ...
    index.apply_event("r1", "removed", 3, "host")  # ... and gone from the host tier
    index.apply_event("r2", "removed", 5, "shared")  # deleted for r2's byte bound
    assert [(m.matched_blocks, m.host_blocks, m.shared_blocks) for m in index.match([1, 2, 3, 4, 5])] == [
        (3, 1, 0), (0, 0, 0)]
    assert index.blocks("r1", "host") == {4, 6} and index.size == 7
    index.forget("r2")  # r2's shared entries are unknown until its next snapshot
    assert index.match([5, 6], ["r1"])[0].shared_blocks == 0
    with pytest.raises(ValueError):
        index.apply_event("r1", "stored", 1, "disk")


async def test_host_and_shared_tier_blocks_reach_the_index(tiny_llama_dir, kv_prefix):
    shared = dict(kv_shared_url=URL, kv_shared_prefix=kv_prefix, kv_host_bytes=1 << 24)
    a, b = Replica(tiny_llama_dir, 24, **shared), Replica(tiny_llama_dir, 64)
    for r in (a, b):
        await r.start()
    cache = await start_cache([a, b])
    index = cache.service.index
    try:
        prompt = "the quick brown fox jumps over the lazy dog"
        await a.generate(prompt)
        assert a.engine.blocks.shared_tier.flush()
        hashes = a.hashes(prompt)
        for i in range(6):  # a's 24 blocks overflow: the prompt's blocks move to its host tier
            await a.generate(f"{i} other words to fill the pool of the first replica", 2)
        assert a.cached("host").issuperset(hashes) and a.cached("shared").issuperset(hashes)
        for _ in range(250):
            if all(index.blocks(a.server.address, t) == a.cached(t) for t in ("device", "host", "shared")):
                break
            await asyncio.sleep(0.02)
        assert [index.blocks(a.server.address, t) == a.cached(t) for t in ("device", "host", "shared")] == [True] * 3
        async with grpc.aio.insecure_channel(cache.address) as channel:
            reply = await cache_service_pb2_grpc.CacheServiceStub(channel).PrefixMatch(
                pb.PrefixMatchRequest(block_hashes=hashes))
        assert [(m.matched_blocks, m.host_blocks, m.shared_blocks) for m in reply.matches] == [
            (0, len(hashes), 0), (0, 0, len(hashes))]  # a restores from its host tier; b could load a's entries
    finally:
        await cache.stop(0)
        for r in (a, b):
            await r.stop()
