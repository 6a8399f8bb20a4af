"""The router's replica score counts a prefix held below a replica's pool at its load cost:
pool blocks in full, host- and shared-tier blocks less their measured load cost relative to
recomputing them, nothing for a tier the replica lacks."""

from __future__ import annotations

import grpc

from services.router.replicas import ReplicaSet, ReplicaStats

TIERS = dict(host_tier_capacity_bytes=1 << 20, shared_tier_capacity_bytes=1 << 20)


def _replicas(*addresses: str) -> ReplicaSet:
    return ReplicaSet(addresses, grpc.aio.insecure_channel, "kv_aware", 1.0)


async def test_tier_blocks_count_less_their_load_cost_against_recompute():
    replica = _replicas("a:1").get("a:1")
    replica.stats = ReplicaStats(**TIERS)
    assert replica.cached_tokens(2, 3, 5, 4) == (2 + 3 + 5) * 4  # unmeasured: in full, as the target restores
    replica.stats = ReplicaStats(**TIERS, recompute_s_per_block=1.0, host_restore_s_per_block=0.1,
                                 shared_load_s_per_block=0.3)
    assert replica.cached_tokens(2, 3, 5, 4) == round((2 + 3 * 0.9 + 5 * (1 - 0.4)) * 4)
    replica.stats = ReplicaStats(**TIERS, recompute_s_per_block=1.0, host_restore_s_per_block=0.1,
                                 shared_load_s_per_block=2.0)
    assert replica.cached_tokens(2, 3, 5, 4) == round((2 + 3 * 0.9) * 4)  # dearer than recompute: nothing
    replica.stats = ReplicaStats(host_tier_capacity_bytes=1 << 20, recompute_s_per_block=1.0)
    assert replica.cached_tokens(2, 3, 5, 4) == (2 + 3) * 4  # no shared tier: it cannot load those
    replica.stats = None
    assert replica.cached_tokens(2, 3, 5, 4) == 2 * 4  # no stats yet: no tier known


async def test_a_cheap_tier_hit_wins_over_recompute_and_a_dear_one_does_not():
    replicas = _replicas("a:1", "b:1")
    a, b = replicas.get("a:1"), replicas.get("b:1")
    a.stats = ReplicaStats(**TIERS)  # nothing of the prompt anywhere
    for load_s, expected in ((0.05, "b:1"), (5.0, None)):
        b.stats = ReplicaStats(**TIERS, recompute_s_per_block=0.5, shared_load_s_per_block=load_s,
                               host_restore_s_per_block=0.01)
        cached = {"a:1": a.cached_tokens(0, 0, 0, 16), "b:1": b.cached_tokens(0, 0, 40, 16)}  # 640 tokens in Redis
        chosen = [replicas.choose(700, cached).address for _ in range(2)]
        assert chosen == ([expected] * 2 if expected else ["a:1", "b:1"])  # dear: a tie, taken in turn
