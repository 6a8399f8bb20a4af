"""KV-aware replica choice: requests go to the replica whose KV holds their prefix.

Two replicas whose KV pools each hold about one tenant's system prompt; two tenants, six
questions each, in the order A, A, B, B, A, A, ... With kv_aware every tenant's later
requests land on the replica holding its prefix, and the prompt tokens served from the
prefix cache are at least 3x those of round_robin in the same test (counts, not times).
"""

from __future__ import annotations

import asyncio

from services.common.mesh_config import MeshConfig, PoolConfig, TenantConfig
from tests.mesh import request
from tests.routing_mesh import generate, prefix_match, start_cache, start_router, start_target

SYSTEM = {
    "a": "You are the support assistant of Acme Rockets. Always answer politely, cite the manual "
         "section, and never promise delivery dates. " * 2,
    "b": "You are the billing assistant of Zenith Bank. Explain fees plainly, never reveal account "
         "numbers, and escalate disputes to a human. " * 2,
}
AUTH = {"a": (("authorization", "Bearer tok-a"),), "b": (("authorization", "Bearer tok-b"),)}
ORDER = ["a", "a", "b", "b"] * 3  # six questions per tenant


async def _run(model_dir, policy: str) -> tuple[int, list[tuple[str, str]]]:
    """(total cached prompt tokens, [(tenant, replica)]) for ORDER under `policy`."""
    # ~43 blocks of system prompt + question + output ~ 51 blocks: one tenant fits in 64, two do not.
    # A small device pool and no host tier: a replica holds only the prefixes routed to it.
    targets = [await start_target(model_dir, num_blocks=64, kv_host_bytes=0) for _ in range(2)]
    addresses = [t.address for t in targets]
    cache = await start_cache(addresses)
    mesh = MeshConfig(pools=(PoolConfig(name="default", model=str(model_dir), replicas=tuple(addresses)),),
                      tenants=(TenantConfig(name="tenant-a", token="tok-a"),
                               TenantConfig(name="tenant-b", token="tok-b")))
    router = await start_router(mesh, cache.address, replica_policy=policy)
    pool = router.service.routing.pools["default"]
    total, placed, asked = 0, [], {"a": 0, "b": 0}
    try:
        for tenant in ORDER:
            asked[tenant] += 1
            prompt = SYSTEM[tenant] + f"Question {asked[tenant]}: how do I reset my device?"
            _, _, last, route = await generate(router.stub, request(prompt, max_tokens=4), AUTH[tenant])
            total += last.usage.cached_prompt_tokens
            placed.append((tenant, route.replica))
            await _settle(router, pool, cache.address, prompt, tenant)
    finally:
        await router.stop()
        await cache.stop(grace=0.5)
        for t in targets:
            await t.stop(grace=0.5)
    return total, placed


async def _settle(router, pool, cache_address, prompt, tenant) -> None:
    """Waits until the router's stats and the cache's prefix index reflect the last request
    (both follow asynchronously in a real mesh; the test wants exact counts)."""
    await pool.replicas.poll_once()
    salt = router.service.auth.salt(f"tenant-{tenant}")
    ids = await pool.tokenize(prompt)
    hashes = pool.block_hashes(ids[:-1], salt)
    for _ in range(1500):  # a bound for a loaded machine, not a timing assertion
        if max((await prefix_match(cache_address, hashes)).values(), default=0) == len(hashes):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the prefix index did not catch up")


async def test_kv_aware_sends_each_tenant_to_its_prefix_and_caches_3x_round_robin(tiny_llama_dir):
    kv_total, kv_placed = await _run(tiny_llama_dir, "kv_aware")
    rr_total, rr_placed = await _run(tiny_llama_dir, "round_robin")
    home = {tenant: replica for tenant, replica in kv_placed[:4:2]}  # first request of each tenant
    assert home["a"] != home["b"]
    assert all(replica == home[tenant] for tenant, replica in kv_placed), kv_placed
    assert len({replica for _, replica in rr_placed}) == 2
    assert kv_total >= 3 * rr_total, (kv_total, rr_total)
    assert kv_total >= 10 * 160  # ten later requests each reuse (almost) their whole system prompt
