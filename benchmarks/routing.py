"""Routing on the default model, one run, side by side (each setup its own fresh servers).

    python benchmarks/routing.py replicas [--tenants 8 --prefix-tokens 1500 --requests 24 --rate 0.3]
    python benchmarks/routing.py length [--docs 4 --doc-tokens 3000 --short 16 --rate 0.5]

`replicas`: two target replicas, tenants each with a shared system prompt of ~prefix-tokens,
KV pools sized so all prefixes fit in the two replicas together but not in one, Poisson
arrivals of (tenant, question) in one seeded order: kv_aware vs least_loaded vs
round_robin — prefix hit rate (cached / prompt tokens), mean and P99 TTFT, throughput.

`length`: short questions mixed with ~doc-tokens documents on two replicas: one pool over
both replicas vs a length pool for short prompts (replica 1) and one for long (replica 2):
short-request mean and P99 TTFT.

Everything runs in this process over real gRPC on loopback (targets, cache service with the
prefix index, router); TTFT is measured at the client (first streamed token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc

from services.cache.app import build_cache_server
from services.cache.config import CacheConfig
from services.settings import read_settings
from services.common.mesh_config import MeshConfig, PoolConfig, TenantConfig
from services.common.models.loading import resolve_model_dir
from specmesh.client import NO_RETRIES, AsyncClient
from specmesh.proto.v1 import common_pb2, router_service_pb2
from services.common.server import GrpcServer, ServerConfig
from services.router.config import RouterConfig
from services.router.service import SERVICE_NAME, RouterService, add_to_server
from services.target.server.app import build_target_server
from services.target.config import EngineConfig
from services.target.engine.engine import Engine

WORDS = ("policy refund order shipping warranty account invoice device battery screen update "
         "support contract region delivery return label billing plan upgrade network").split()


async def start_mesh(model_dir: Path, pools: list[tuple[str, int, int]], num_blocks: int, policy: str,
                     tenants: list[str]):
    """pools: (name, first replica index, replica count, max_context) -> (servers, router client)."""
    engine_config = EngineConfig(model_dir=model_dir, dtype="bfloat16", block_size=16, num_blocks=num_blocks,
                                 max_batched_tokens=512, max_tokens_limit=256)
    count = max(first + n for _, first, n, _ in pools)
    targets = []
    for _ in range(count):
        target = build_target_server(ServerConfig(port=0), Engine.load(replace(engine_config)), "default")
        await target.start()
        targets.append(target)
    cache = build_cache_server(CacheConfig(server=ServerConfig(port=0), replicas=tuple(t.address for t in targets)))
    await cache.start()
    mesh = MeshConfig(
        pools=tuple(PoolConfig(name=name, model=str(model_dir), max_context=limit, price_prompt_per_1k=i,
                               replicas=tuple(t.address for t in targets[first:first + n]))
                    for i, (name, first, n, limit) in enumerate(pools)),
        tenants=tuple(TenantConfig(name=t, token=f"tok-{t}") for t in tenants))
    service = RouterService(RouterConfig(target_address="", mesh=mesh, cache_address=cache.address,
                                         replica_policy=policy, poll_interval_s=0.5, speculation_method="off",
                                         max_tokens_limit=256))
    router = GrpcServer(ServerConfig(port=0), lambda s: add_to_server(s, service), [SERVICE_NAME],
                        on_stopped=service.close)
    await service.start()
    await router.start()
    return [router, cache, *targets], AsyncClient(router.address, retry=NO_RETRIES)


async def stop(servers, client: AsyncClient) -> None:
    await client.close()
    for server in servers:
        await server.stop(grace=0.5)


async def one(client: AsyncClient, tenant: str, prompt: str, max_tokens: int, start: float, index: int = 0) -> dict:
    """Streams one request; returns its TTFT, end time and usage."""
    req = router_service_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    first, last = None, None
    try:
        async for response in client.stream(req, metadata=(("authorization", f"Bearer tok-{tenant}"),),
                                            timeout=1800):
            if first is None and response.chunk.token_ids:
                first = time.monotonic()
            last = response
    except grpc.aio.AioRpcError as exc:
        print(f"request failed: {exc.code().name}: {exc.details()}", flush=True)
        return dict(failed=True)
    usage = last.chunk.usage
    return dict(ttft=first - start, end=time.monotonic(), sent=start, prompt=usage.prompt_tokens, tenant=tenant, index=index,
                cached=usage.cached_prompt_tokens, completion=usage.completion_tokens, replica=last.route.replica)


async def poisson(client: AsyncClient, plan: list[tuple[str, str, int]], rate: float, seed: int) -> list[dict]:
    """Sends plan's (tenant, prompt, max_tokens) with exponential gaps of mean 1/rate."""
    rng = random.Random(seed + 1)
    tasks, t0 = [], time.monotonic()
    for i, (tenant, prompt, max_tokens) in enumerate(plan):
        tasks.append(asyncio.ensure_future(one(client, tenant, prompt, max_tokens, time.monotonic(), i)))
        await asyncio.sleep(rng.expovariate(rate))
    results = [r for r in await asyncio.gather(*tasks) if not r.get("failed")]
    if len(results) < len(plan):
        print(f"{len(plan) - len(results)} of {len(plan)} requests failed", flush=True)
    for r in results:
        r["t0"] = t0
    return results


def system_prompt(tenant: int, tokens: int, rng: random.Random, tokenizer) -> str:
    """About `tokens` tokens (in the model's tokenizer) of seeded words."""
    text = f"System prompt of tenant {tenant}."
    while len(tokenizer(text).input_ids) < tokens:
        text += " " + " ".join(rng.choice(WORDS) for _ in range(16))
    return text + "\n"


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def percentile(values: list[float], q: float) -> float:
    """Nearest rank (with under 100 values P99 is the maximum)."""
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def summary(results: list[dict]) -> dict:
    ttfts = [r["ttft"] for r in results]
    wall = max(r["end"] for r in results) - results[0]["t0"]
    return dict(hit=sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
                mean_ttft=statistics.mean(ttfts), p99_ttft=percentile(ttfts, 0.99),
                tok_s=sum(r["completion"] for r in results) / wall, req_s=len(results) / wall, wall_s=wall,
                n=len(results))


def repeats(plan: list[tuple[str, str, int]]) -> list[bool]:
    """Per request: has its tenant been seen before in the plan (a first request can never hit)?"""
    seen: set[str] = set()
    out = []
    for tenant, _, _ in plan:
        out.append(tenant in seen)
        seen.add(tenant)
    return out


def lru_model(tenants: list[str], replica_of, slots: int, replicas: int = 2) -> float:
    """Share of requests whose prefix is cached, in a prefix-granular LRU model of `replicas`
    pools of `slots` prefixes each; replica_of(i, tenant) places request i. A cross-check for
    the measured rates (counts of whole prefixes; the engine evicts blocks, tail first)."""
    pools = [[] for _ in range(replicas)]
    hits = 0
    for i, tenant in enumerate(tenants):
        pool = pools[replica_of(i, tenant)]
        if tenant in pool:
            hits += 1
            pool.remove(tenant)
        elif len(pool) == slots:
            pool.pop(0)
        pool.append(tenant)
    return hits / len(tenants)


def placement(results: list[dict]) -> dict:
    """Per tenant: requests per replica (replicas named r0, r1 in order of first use) and
    how many of the tenant's requests left the replica it used most (its 'home')."""
    names: dict[str, str] = {}
    per: dict[str, dict[str, int]] = {}
    for r in sorted(results, key=lambda r: r["index"]):
        name = names.setdefault(r["replica"], f"r{len(names)}")
        per.setdefault(r["tenant"], {}).setdefault(name, 0)
        per[r["tenant"]][name] += 1
    away = sum(sum(c.values()) - max(c.values()) for c in per.values())
    return dict(per_tenant=per, away_from_home=away)


def save(out: Path, setup: dict, rows: dict, extra: dict) -> None:
    """out.json (everything), out.md (the table), out.png (hit rate and TTFT bars) when matplotlib is there."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(setup=setup, rows=rows, **extra), indent=2) + "\n")
    lines = [f"# routing {setup['what']}", "", "`" + setup["command"] + "`", "",
             ", ".join(f"{k}={v}" for k, v in setup.items() if k not in ("what", "command")), "",
             "| policy | hit rate | hit rate on repeats | mean TTFT s | P95 TTFT s | P99 TTFT s | "
             "P99 TTFT of repeats s | tok/s | req/s | n |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for name, r in rows.items():
        lines.append(f"| {name} | {r['hit']:.1%} | {r.get('hit_repeats', nan):.1%} | {r['mean_ttft']:.2f} | "
                     f"{r.get('p95_ttft', nan):.2f} | {r['p99_ttft']:.2f} | {r.get('p99_ttft_repeats', nan):.2f} | "
                     f"{r['tok_s']:.2f} | {r['req_s']:.3f} | {r['n']} |")
    lines += [""] + [f"- {k}: {v}" for k, v in extra.items() if k not in ("placement", "requests")]
    if "placement" in extra:  # per-tenant counts are in the json
        lines.append("- requests away from their tenant's most used replica: "
                     + ", ".join(f"{k} {v['away_from_home']}" for k, v in extra["placement"].items()))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = list(rows)
    axes[0].bar(names, [rows[n]["hit"] for n in names])
    axes[0].set_ylabel("prefix hit rate (cached / prompt tokens)")
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], [rows[n]["mean_ttft"] for n in names], 0.4, label="mean")
    axes[1].bar([i + 0.2 for i in x], [rows[n]["p99_ttft"] for n in names], 0.4, label="P99")
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("TTFT (s)")
    axes[1].legend()
    fig.suptitle(setup.get("title", setup["what"]))
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


async def bench_replicas(model_dir: Path, args) -> None:
    rng = random.Random(args.seed)
    tenants = [f"t{i}" for i in range(args.tenants)]
    tokenizer = _tokenizer(model_dir)
    prompts = {t: system_prompt(i, args.prefix_tokens, rng, tokenizer) for i, t in enumerate(tenants)}
    plan = [(t := rng.choice(tenants), prompts[t] + f"Question {i}: what about item {i}?", args.max_tokens)
            for i in range(args.requests)]
    # All prefixes fit in the two replicas together, not in one: room for tenants // 2 + 1
    # requests (prefix + question + output) per replica, i.e. 5 of 8 prefixes.
    prefix_lengths = [len(tokenizer(p).input_ids) for p in prompts.values()]
    longest = max(len(tokenizer(p).input_ids) for _, p, _ in plan) + args.max_tokens
    slots = args.tenants // 2 + 1
    num_blocks = math.ceil(longest * slots / 16)
    repeat = repeats(plan)
    order = [t for t, _, _ in plan]
    setup = dict(what="replicas", command="PYTHONPATH=. python " + " ".join(sys.argv), model=str(model_dir.name),
                 tenants=args.tenants, prefix_tokens=f"{min(prefix_lengths)}-{max(prefix_lengths)}",
                 requests=args.requests, first_requests=repeat.count(False), rate_per_s=args.rate,
                 max_tokens=args.max_tokens, seed=args.seed, replicas=2, blocks_per_replica=num_blocks,
                 block_size=16, prefix_slots_per_replica=slots,
                 title=f"2 replicas, {args.tenants} tenants x ~{args.prefix_tokens}-token prefix, "
                       f"{args.requests} requests, Poisson {args.rate}/s")
    print(", ".join(f"{k}={v}" for k, v in setup.items() if k != "title"), flush=True)
    # Whole-prefix LRU model of the same order: kv_aware with every tenant kept on one replica
    # (tenants split evenly), and round_robin alternating replicas by arrival.
    home = {t: i % 2 for i, t in enumerate(dict.fromkeys(order))}
    model = dict(kv_aware_ideal=lru_model(order, lambda i, t: home[t], slots),
                 round_robin=lru_model(order, lambda i, t: i % 2, slots))
    print(f"prefix LRU model (share of requests that hit): {model}", flush=True)
    rows, placements, per_request = {}, {}, {}
    for policy in ("kv_aware", "least_loaded", "round_robin"):
        servers, client = await start_mesh(model_dir, [("default", 0, 2, 0)], num_blocks, policy, tenants)
        try:
            results = await poisson(client, plan, args.rate, args.seed)
        finally:
            await stop(servers, client)
        rows[policy] = summary(results)
        later = [r for r in results if repeat[r["index"]]]
        rows[policy]["hit_repeats"] = sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later))
        rows[policy]["hit_requests"] = sum(r["cached"] >= 0.9 * min(prefix_lengths) for r in results)
        rows[policy]["p95_ttft"] = percentile([r["ttft"] for r in results], 0.95)
        rows[policy]["p99_ttft_repeats"] = percentile([r["ttft"] for r in later], 0.99)
        rows[policy]["max_ttft_first"] = max(r["ttft"] for r in results if not repeat[r["index"]])
        per_request[policy] = [dict(index=r["index"], tenant=r["tenant"], replica=r["replica"], ttft=round(r["ttft"], 4),
                                    sent_s=round(r["sent"] - r["t0"], 3), prompt=r["prompt"], cached=r["cached"])
                               for r in sorted(results, key=lambda r: r["index"])]
        placements[policy] = placement(results)
        print(f"{policy:>13}: hit rate {rows[policy]['hit']:.1%} (repeats {rows[policy]['hit_repeats']:.1%}, "
              f"{rows[policy]['hit_requests']} requests hit)  TTFT mean {rows[policy]['mean_ttft']:.2f} s  "
              f"P99 {rows[policy]['p99_ttft']:.2f} s (P95 {rows[policy]['p95_ttft']:.2f}, repeats' P99 "
              f"{rows[policy]['p99_ttft_repeats']:.2f}, first requests' max {rows[policy]['max_ttft_first']:.2f})  "
              f"{rows[policy]['tok_s']:.2f} tok/s  "
              f"{placements[policy]['away_from_home']} requests away from their tenant's home", flush=True)
    rr, kv = rows["round_robin"], rows["kv_aware"]
    ratios = dict(hit_kv_over_rr=kv["hit"] / max(rr["hit"], 1e-9), p99_rr_over_kv=rr["p99_ttft"] / kv["p99_ttft"],
                  mean_rr_over_kv=rr["mean_ttft"] / kv["mean_ttft"])
    print(f"kv_aware vs round_robin: hit rate x{ratios['hit_kv_over_rr']:.2f}, "
          f"P99 TTFT x{ratios['p99_rr_over_kv']:.2f} lower, mean TTFT x{ratios['mean_rr_over_kv']:.2f} lower")
    if args.out:
        save(Path(args.out), setup, rows, dict(ratios=ratios, lru_model=model, placement=placements,
                                               requests=per_request))


async def bench_length(model_dir: Path, args) -> None:
    rng = random.Random(args.seed)
    tokenizer = _tokenizer(model_dir)
    docs = [system_prompt(100 + i, args.doc_tokens, rng, tokenizer) for i in range(args.docs)]
    plan = [("t0", f"Summarize this document.\n{d}", 8) for d in docs]
    plan += [("t0", f"Short question {i}: what is {rng.choice(WORDS)}?", 8) for i in range(args.short)]
    rng.shuffle(plan)
    num_blocks = math.ceil((args.doc_tokens + 64) * max(2, args.docs) / 16)
    rows = {}
    setups = {"one shared pool": [("shared", 0, 2, 0)],
              "length pools": [("short", 0, 1, 512), ("long", 1, 1, 0)]}
    print(f"{args.docs} documents of ~{args.doc_tokens} tokens + {args.short} short questions, Poisson {args.rate}/s")
    for name, pools in setups.items():
        servers, client = await start_mesh(model_dir, pools, num_blocks, "kv_aware", ["t0"])
        try:
            results = await poisson(client, plan, args.rate, args.seed)
        finally:
            await stop(servers, client)
        rows[name] = summary([r for r in results if r["prompt"] < 512])
        print(f"{name:>16}: short requests TTFT mean {rows[name]['mean_ttft']:.2f} s  "
              f"P99 {rows[name]['p99_ttft']:.2f} s", flush=True)
    print(f"short-request P99 TTFT: x{rows['one shared pool']['p99_ttft'] / rows['length pools']['p99_ttft']:.2f} "
          f"lower with length pools")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("replicas", "length"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=0.3, help="mean arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--out", default="", help="write OUT.json, OUT.md (and OUT.png) with the results, "
                        "e.g. benchmarks/results/routing_replicas")
    args = parser.parse_args()
    settings = read_settings()
    model_dir = resolve_model_dir(args.model, Path(settings.model_cache).expanduser())
    asyncio.run((bench_replicas if args.what == "replicas" else bench_length)(model_dir, args))


if __name__ == "__main__":
    main()
