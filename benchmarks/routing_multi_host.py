"""Routing with each target on a host of its own (tests/netns.py; needs root), one run:
kv_aware vs least_loaded vs round_robin, beside an oracle that knows every replica's cache.

    sudo PYTHONPATH=. python benchmarks/routing_multi_host.py [--hosts 3 --tenants 12
        --prefix-tokens 1000 --requests 36 --rate 0.3 --model default --out OUT]

Each policy gets fresh targets: `specmesh serve target` in its own network namespace and
address (its own process, so its own queue), named `target-N.bench.specmesh.test` in
/etc/hosts and found by the router and the cache's prefix index through one DNS entry
(`dns:///targets.bench.specmesh.test:50052`, like a headless Service), over mutual TLS.
The same seeded Poisson plan as benchmarks/routing.py `replicas` (tenants with shared
system prompts; KV pools sized so all prefixes fit in the hosts together, not in one).

The oracle: Belady's MIN (evict, or do not admit, the prefix used again latest) over one
cache of every host's capacity together, counted in prefixes: each host holds at most
num_blocks // the blocks of 90% of the shortest prefix (a hit, below) of them (an
over-estimate: it leaves no room for running requests). Any placement of the requests on
the hosts, with any eviction, holds at most that many prefixes at once, and MIN is optimal
for one cache, so no routing hits on more requests: an upper bound, not a model of one
policy. With room for every tenant it is simply the share of requests whose tenant was
seen before.
Reported: per policy the share of requests that hit (cached >= 90% of the shortest
prefix), token hit rate, TTFT P50/P99, kv_aware's request hit share / the oracle's, and
the CPU used by processes other than this one and its targets while the policies ran.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks.routing import _tokenizer, percentile, poisson, repeats, save, summary, system_prompt
from services.bench.foreign_cpu import ForeignCpu
from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.common.mesh_config import MeshConfig, PoolConfig, TenantConfig
from services.common.models.loading import resolve_model_dir
from services.common.server import GrpcServer, ServerConfig
from services.common.tls import MeshTls, make_dev_certs
from services.router.config import RouterConfig
from services.router.service import SERVICE_NAME, RouterService, add_to_server
from services.settings import read_settings
from specmesh.client import NO_RETRIES, AsyncClient
from tests.netns import Hosts, NetnsHost, netns_available
from tests.router.test_multi_host import _wait_serving

DOMAIN = "bench.specmesh.test"
POOL, PORT, BLOCK = f"targets.{DOMAIN}", 50052, 16


def oracle_hits(order: list[str], capacity: int) -> float:
    """Share of requests that hit under Belady's MIN with `capacity` prefixes (the module docstring)."""
    cached: set[str] = set()
    hits = 0
    for i, tenant in enumerate(order):
        if tenant in cached:
            hits += 1
            continue
        cached.add(tenant)
        if len(cached) > capacity:  # drop the one used again latest (or never): maybe this one
            later = order[i + 1:]
            cached.remove(max(cached, key=lambda t: later.index(t) if t in later else math.inf))
    return hits / len(order)


async def run_policy(policy: str, model_dir: Path, certs: Path, num_blocks: int, hosts_n: int,
                     tenants: list[str], plan, args) -> list[dict]:
    router_tls, cache_tls = MeshTls.from_dir(certs, "router"), MeshTls.from_dir(certs, "cache")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPECMESH_TLS_DIR": str(certs)}
    with ExitStack() as stack:
        hosts = stack.enter_context(Hosts())
        machines = [stack.enter_context(NetnsHost(i)) for i in range(hosts_n)]
        procs = [m.popen([sys.executable, "-m", "services.cli", "serve", "target", "--host", m.address,
                          "--port", str(PORT), "--model", str(model_dir), "--dtype", "bfloat16",
                          "--block-size", str(BLOCK), "--num-blocks", str(num_blocks),
                          "--speculation-method", "off", "--metrics-port", "0"], env) for m in machines]
        for i, (machine, proc) in enumerate(zip(machines, procs)):
            hosts.add(machine.address, f"target-{i}.{DOMAIN}")
            _wait_serving(proc, f"target-{i}.{DOMAIN}", router_tls, timeout_s=600)
        for machine in machines:
            hosts.add(machine.address, POOL)
        entry = f"dns:///{POOL}:{PORT}"
        cache = build_cache_server(CacheConfig(server=ServerConfig(port=0, tls=cache_tls.server_tls()),
                                               replicas=(entry,), mesh_tls=cache_tls))
        await cache.start()
        mesh = MeshConfig(pools=(PoolConfig(name="default", model=str(model_dir), replicas=(entry,)),),
                          tenants=tuple(TenantConfig(name=t, token=f"tok-{t}") for t in tenants))
        service = RouterService(RouterConfig(target_address="", mesh=mesh, cache_address=cache.address,
                                             mesh_tls=router_tls, replica_policy=policy, poll_interval_s=0.5,
                                             speculation_method="off", max_tokens_limit=256))
        router = GrpcServer(ServerConfig(port=0), lambda s: add_to_server(s, service), [SERVICE_NAME],
                            on_stopped=service.close)
        await service.start()
        await router.start()
        client = AsyncClient(router.address, retry=NO_RETRIES)
        try:
            deadline = time.monotonic() + 30  # the prefix index synced with every host
            while not all(cache.service.index.is_synced(f"target-{i}.{DOMAIN}:{PORT}") for i in range(hosts_n)):
                assert time.monotonic() < deadline, "the prefix index did not sync"
                await asyncio.sleep(0.2)
            return await poisson(client, plan, args.rate, args.seed)
        finally:
            await client.close()
            await router.stop(grace=0.5)
            await cache.stop(grace=0.5)


async def bench(model_dir: Path, args) -> None:
    rng = random.Random(args.seed)
    tenants = [f"t{i}" for i in range(args.tenants)]
    tokenizer = _tokenizer(model_dir)
    prompts = {t: system_prompt(i, args.prefix_tokens, rng, tokenizer) for i, t in enumerate(tenants)}
    plan = [(t := rng.choice(tenants), prompts[t] + f"Question {i}: what about item {i}?", args.max_tokens)
            for i in range(args.requests)]
    prefix_lengths = [len(tokenizer(p).input_ids) for p in prompts.values()]
    shortest = min(prefix_lengths)
    longest = max(len(tokenizer(p).input_ids) for _, p, _ in plan) + args.max_tokens
    slots = args.tenants // args.hosts + 1  # all prefixes fit in the hosts together, not in one
    num_blocks = math.ceil(longest * slots / BLOCK)
    order = [t for t, _, _ in plan]
    repeat = repeats(plan)
    capacity = args.hosts * (num_blocks // math.ceil(0.9 * shortest / BLOCK))  # hits held at once
    oracle = oracle_hits(order, capacity)
    setup = dict(what="multi-host replicas", command="PYTHONPATH=. python " + " ".join(sys.argv),
                 model=model_dir.name, hosts=args.hosts, tenants=args.tenants,
                 prefix_tokens=f"{min(prefix_lengths)}-{max(prefix_lengths)}", requests=args.requests,
                 first_requests=repeat.count(False), rate_per_s=args.rate, max_tokens=args.max_tokens,
                 seed=args.seed, blocks_per_host=num_blocks, block_size=BLOCK, prefix_slots_per_host=slots,
                 oracle_capacity_prefixes=capacity,
                 title=f"{args.hosts} hosts (netns), {args.tenants} tenants x ~{args.prefix_tokens}-token prefix, "
                       f"{args.requests} requests, Poisson {args.rate}/s")
    print(", ".join(f"{k}={v}" for k, v in setup.items() if k != "title"), flush=True)
    print(f"oracle (MIN over {capacity} prefixes): {oracle:.1%} of requests hit", flush=True)
    rows, per_request, foreign = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp, ForeignCpu() as cpu:  # this process and its targets are ours
        certs = make_dev_certs(Path(tmp) / "certs", hosts=[f"target=*.{DOMAIN}"])
        for policy in args.policies.split(","):
            results = await run_policy(policy, model_dir, certs, num_blocks, args.hosts, tenants, plan, args)
            ran = (results[0]["t0"], max(r["end"] for r in results))
            foreign[policy] = cpu.share(*ran)
            row = summary(results)
            later = [r for r in results if repeat[r["index"]]]
            row["hit_repeats"] = sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later))
            row["request_hits"] = sum(r["cached"] >= 0.9 * shortest for r in results) / len(results)
            row["p50_ttft"] = percentile([r["ttft"] for r in results], 0.50)
            row["p95_ttft"] = percentile([r["ttft"] for r in results], 0.95)
            row["p99_ttft_repeats"] = percentile([r["ttft"] for r in later], 0.99)
            rows[policy] = row
            per_request[policy] = [dict(index=r["index"], tenant=r["tenant"], replica=r["replica"],
                                        ttft=round(r["ttft"], 4), sent_s=round(r["sent"] - r["t0"], 3),
                                        prompt=r["prompt"], cached=r["cached"])
                                   for r in sorted(results, key=lambda r: r["index"])]
            print(f"{policy:>13}: requests hit {row['request_hits']:.1%} (oracle {oracle:.1%})  token hit rate "
                  f"{row['hit']:.1%}  TTFT P50 {row['p50_ttft']:.2f} s  P99 {row['p99_ttft']:.2f} s  "
                  f"foreign CPU median {100 * (foreign[policy]['median'] or 0):.1f}% "
                  f"max {100 * (foreign[policy]['max'] or 0):.1f}%", flush=True)
    extra = dict(oracle_request_hits=oracle, request_hits={k: r["request_hits"] for k, r in rows.items()},
                 p50_ttft={k: round(r["p50_ttft"], 3) for k, r in rows.items()}, foreign_cpu=foreign)
    if "kv_aware" in rows and "round_robin" in rows:
        kv, rr = rows["kv_aware"], rows["round_robin"]
        extra["kv_aware_of_oracle"] = kv["request_hits"] / max(oracle, 1e-9)
        extra["p99_rr_over_kv"] = rr["p99_ttft"] / kv["p99_ttft"]
        print(f"kv_aware: {extra['kv_aware_of_oracle']:.1%} of the oracle's hit share; "
              f"P99 TTFT x{extra['p99_rr_over_kv']:.2f} lower than round_robin")
    if any(f["void"] for f in foreign.values()):
        print("VOID: another process used the machine while a policy ran")
    if args.out:
        save(Path(args.out), setup, rows, dict(extra, requests=per_request))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=36)
    parser.add_argument("--rate", type=float, default=0.3, help="mean arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="kv_aware,least_loaded,round_robin")
    parser.add_argument("--out", default="", help="write OUT.json, OUT.md (and OUT.png), "
                        "e.g. benchmarks/results/routing_multi_host")
    args = parser.parse_args()
    why_not = netns_available()
    if why_not:
        sys.exit(f"network namespaces: {why_not}")
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    asyncio.run(bench(model_dir, args))


if __name__ == "__main__":
    main()
