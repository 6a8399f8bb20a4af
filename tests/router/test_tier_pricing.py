"""The router's replica score counts a prefix held below a replica's pool at its load cost:
pool blocks in full, a host-tier block at the replica's mean stored bytes per block over its
measured restore bandwidth, a shared-tier block at the measured Redis load plus a full block over
that bandwidth, each relative to recomputing the block; nothing for a tier the replica lacks.
A replica whose host tier holds FP8 copies (smaller) restores a block for less, and wins a
request a full-precision replica holding the same prefix would also serve."""

from __future__ import annotations

import grpc

from services.router.replicas import ReplicaSet, ReplicaStats, replica_stats
from specmesh.proto.v1 import target_service_pb2

TIERS = dict(host_tier_capacity_bytes=1 << 20, shared_tier_capacity_bytes=1 << 20)
MB = 1 << 20


def _replicas(*addresses: str) -> ReplicaSet:
    return ReplicaSet(addresses, grpc.aio.insecure_channel, "kv_aware", 1.0)


async def test_tier_blocks_count_less_their_load_cost_against_recompute():
    replica = _replicas("a:1").get("a:1")
    replica.stats = ReplicaStats(**TIERS, block_bytes=MB)
    assert replica.cached_tokens(2, 3, 5, 4) == (2 + 3 + 5) * 4  # unmeasured: in full, as the target restores
    # 1 MB blocks at 10 MB/s: 0.1 s a host-tier block; 0.3 s Redis + 0.1 s restore a shared-tier one.
    replica.stats = ReplicaStats(**TIERS, block_bytes=MB, restore_bytes_per_s=10 * MB, recompute_s_per_block=1.0,
                                 shared_redis_s_per_block=0.3)
    assert replica.cached_tokens(2, 3, 5, 4) == round((2 + 3 * 0.9 + 5 * (1 - 0.4)) * 4)
    replica.stats = ReplicaStats(**TIERS, block_bytes=MB, restore_bytes_per_s=10 * MB, recompute_s_per_block=1.0,
                                 shared_redis_s_per_block=2.0)
    assert replica.cached_tokens(2, 3, 5, 4) == round((2 + 3 * 0.9) * 4)  # dearer than recompute: nothing
    replica.stats = ReplicaStats(host_tier_capacity_bytes=1 << 20, recompute_s_per_block=1.0)
    assert replica.cached_tokens(2, 3, 5, 4) == (2 + 3) * 4  # no shared tier: it cannot load those
    replica.stats = None
    assert replica.cached_tokens(2, 3, 5, 4) == 2 * 4  # no stats yet: no tier known


async def test_a_host_tier_hit_costs_the_stored_bytes_per_block_over_the_measured_bandwidth():
    replica = _replicas("a:1").get("a:1")
    full = ReplicaStats(**TIERS, block_bytes=MB, host_bytes_per_block=MB, restore_bytes_per_s=4 * MB,
                        recompute_s_per_block=0.5)
    fp8 = ReplicaStats(**{**full.__dict__, "host_bytes_per_block": MB // 4})  # a quarter: FP8 of an fp32 pool
    assert (full.host_restore_s_per_block, fp8.host_restore_s_per_block) == (0.25, 0.0625)
    replica.stats = full
    assert replica.cached_tokens(0, 8, 0, 16) == round(8 * (1 - 0.5) * 16)
    replica.stats = fp8
    assert replica.cached_tokens(0, 8, 0, 16) == round(8 * (1 - 0.125) * 16)
    # Twice the bandwidth: half the cost. A shared-tier block restores a full block whatever the host tier holds.
    replica.stats = ReplicaStats(**{**fp8.__dict__, "restore_bytes_per_s": 8 * MB, "shared_redis_s_per_block": 0.1})
    assert replica.cached_tokens(0, 8, 8, 16) == round((8 * (1 - 0.0625) + 8 * (1 - (0.1 + 0.125) / 0.5)) * 16)


def test_stats_from_get_stats_mean_bytes_per_block_of_prefix_entries_bandwidth_and_redis_load():
    reply = target_service_pb2.GetStatsResponse(
        block_size=4, kv_block_bytes=4096, host_tier_capacity_bytes=1 << 20,
        host_tier_bytes=3 * 4096 + 5 * 1100 + 2 * 4096, host_tier_swap_bytes=2 * 4096, host_tier_blocks=8,
        host_tier_restore_bandwidth=2e8, shared_tier_loaded_blocks=10, shared_tier_load_seconds=0.02,
        recompute_seconds_per_block=1e-4)
    s = replica_stats(reply)
    assert s.host_bytes_per_block == (3 * 4096 + 5 * 1100) / 8  # swapped sequences' bytes are not entries
    assert s.host_restore_s_per_block == s.host_bytes_per_block / 2e8
    assert s.shared_load_s_per_block == 0.02 / 10 + 4096 / 2e8
    empty = replica_stats(target_service_pb2.GetStatsResponse(kv_block_bytes=4096, host_tier_restore_bandwidth=2e8))
    assert empty.host_restore_s_per_block == 4096 / 2e8  # nothing held: priced as a full block


async def test_a_cheap_tier_hit_wins_over_recompute_and_a_dear_one_does_not():
    replicas = _replicas("a:1", "b:1")
    a, b = replicas.get("a:1"), replicas.get("b:1")
    a.stats = ReplicaStats(**TIERS)  # nothing of the prompt anywhere
    for redis_s, expected in ((0.05, "b:1"), (5.0, None)):
        b.stats = ReplicaStats(**TIERS, block_bytes=MB, restore_bytes_per_s=100 * MB, recompute_s_per_block=0.5,
                               shared_redis_s_per_block=redis_s)
        cached = {"a:1": a.cached_tokens(0, 0, 0, 16), "b:1": b.cached_tokens(0, 0, 40, 16)}  # 640 tokens in Redis
        chosen = [replicas.choose(700, cached).address for _ in range(2)]
        assert chosen == ([expected] * 2 if expected else ["a:1", "b:1"])  # dear: a tie, taken in turn


async def test_an_fp8_host_tier_replica_wins_over_a_full_precision_one_holding_the_same_prefix():
    """Both hold a 40-block prefix in their host tiers, restore at the same measured bandwidth and
    recompute at the same cost; the full-precision replica is a little less loaded. Its 1 MB blocks
    cost 80% of a recompute each, the FP8 replica's quarter-size ones 20%: the FP8 one is chosen,
    every time. With equal bytes per block the less loaded one wins."""
    replicas = _replicas("full:1", "fp8:1")
    full, fp8 = replicas.get("full:1"), replicas.get("fp8:1")
    measured = dict(**TIERS, block_bytes=MB, restore_bytes_per_s=10 * MB, recompute_s_per_block=0.125)
    full.stats = ReplicaStats(**measured, host_bytes_per_block=MB)
    fp8.stats = ReplicaStats(**measured, host_bytes_per_block=MB / 4, queued_tokens=100,
                             cold_precision="fp8", host_tier_cold_blocks=40, host_tier_cold_bytes=10 * MB)
    cached = {r.address: r.cached_tokens(0, 40, 0, 16) for r in (full, fp8)}
    assert cached == {"full:1": round(40 * 0.2 * 16), "fp8:1": round(40 * 0.8 * 16)}
    assert [replicas.choose(700, cached).address for _ in range(3)] == ["fp8:1"] * 3
    fp8.stats = ReplicaStats(**{**fp8.stats.__dict__, "host_bytes_per_block": MB})
    cached = {r.address: r.cached_tokens(0, 40, 0, 16) for r in (full, fp8)}
    assert [replicas.choose(700, cached).address for _ in range(3)] == ["full:1"] * 3
