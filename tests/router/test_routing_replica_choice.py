"""Replica choice inside a pool, exact picks per policy (no servers: stats set by hand)."""

from __future__ import annotations

import grpc

from services.router.pools import PrefixLookup
from services.router.replicas import ReplicaSet, ReplicaStats

ADDRESSES = ("r0:1", "r1:1", "r2:1")


def _set(policy: str, queued=(0, 0, 0), cached_blocks=(0, 0, 0)) -> ReplicaSet:
    replicas = ReplicaSet(ADDRESSES, lambda a: grpc.aio.insecure_channel(a), policy, poll_interval_s=1.0)
    for r, q, c in zip(replicas.replicas, queued, cached_blocks):
        r.stats = ReplicaStats(queued_tokens=q, num_blocks=100, free_blocks=100, cached_blocks=c)
    return replicas


async def test_kv_aware_trades_cached_prefix_against_load():
    replicas = _set("kv_aware", queued=(0, 300, 0))
    # r1 holds 400 of 500 prompt tokens and has 300 queued: 100 uncached + 300/2 = 250 < 500 elsewhere.
    assert replicas.choose(500, {"r1:1": 400}).address == "r1:1"
    # With 900 queued it no longer pays: 100 + 450 = 550 > 500 on r0 / r2.
    replicas.get("r1:1").stats.queued_tokens = 900
    assert replicas.choose(500, {"r1:1": 400}).address in ("r0:1", "r2:1")
    # Router-side in-flight work counts as load before the next stats poll.
    replicas.get("r1:1").stats.queued_tokens = 0
    replicas.get("r1:1").in_flight_tokens = 900
    assert replicas.choose(500, {"r1:1": 400}).address != "r1:1"


async def test_kv_aware_keeps_a_prefix_home_behind_one_other_prefill():
    """The multi-host benchmark's misses: a 1012-token prompt whose 992-token prefix r1 holds,
    r1 busy with another tenant's 1011-token prefill (+ 8 decode tokens), r0 and r2 idle.
    Recomputing elsewhere is an even trade for this request and 1000 tokens of extra work
    (and a duplicate prefix) for the mesh: it stays on r1. Two prefills behind, it moves."""
    replicas = _set("kv_aware", queued=(0, 1019, 0))
    assert replicas.choose(1012, {"r1:1": 992}).address == "r1:1"
    replicas.get("r1:1").stats.queued_tokens = 2 * 1019
    assert replicas.choose(1012, {"r1:1": 992}).address in ("r0:1", "r2:1")


async def test_a_prompt_in_flight_counts_its_leading_blocks_as_held_there():
    replicas = _set("kv_aware")
    r1 = replicas.get("r1:1")
    r1.sent[object()] = [11, 12, 13, 14]
    r1.sent[object()] = [11, 12, 99]
    assert [r1.sent_blocks(h) for h in ([11, 12, 13, 20], [11, 12, 99, 5], [7, 11], [])] == [3, 3, 0, 0]
    cached = await PrefixLookup(None).cached_tokens([11, 12, 13, 20], replicas.replicas, 16)  # no index
    assert cached == {"r1:1": 48}


async def test_kv_aware_ties_go_to_the_replica_with_least_cached_kv():
    replicas = _set("kv_aware", cached_blocks=(60, 10, 30))
    assert [replicas.choose(100, {}).address for _ in range(3)] == ["r1:1"] * 3


async def test_least_loaded_and_round_robin_and_exclusion():
    replicas = _set("least_loaded", queued=(50, 10, 20))
    assert replicas.choose(100, {"r0:1": 100}).address == "r1:1"  # cached prefixes are ignored
    assert replicas.choose(100, {}, exclude={"r1:1"}).address == "r2:1"
    rr = _set("round_robin")
    assert [rr.choose(1, {}).address for _ in range(4)] == ["r0:1", "r1:1", "r2:1", "r0:1"]
    assert rr.choose(1, {}, peek=True).address == "r1:1" == rr.choose(1, {}).address  # peek takes no turn
    rr.mark_failed(rr.get("r2:1"))
    assert sorted(rr.choose(1, {}).address for _ in range(2)) == ["r0:1", "r1:1"]  # ejected: skipped
    assert rr.choose(1, {}, exclude={"r0:1", "r1:1"}) is None
