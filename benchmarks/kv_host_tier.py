"""The host tier below the KV pool (--kv-host-bytes), default model, one run, side by side:

1. Restore cost per block against recompute cost per block: a prefix evicted from the pool is
   restored from the host tier (its TTFT, and the tier's own restore time) or recomputed.
2. Multi-turn chat: conversations of several turns, each turn appending to its history, arriving
   as a Poisson process, on a device pool holding about a quarter of the working set; TTFT P50
   and P99 with the host tier and without it, and whether the outputs are the same. By default the
   rate is --load (0.6) of what the side with the tier serves at saturation, measured first.
3. Cross-replica (with --shared-url): replica A computes a prefix and writes it to the shared
   tier in Redis; replica B's TTFT for that prefix, loaded from there (prefetch included),
   against B's TTFT for a prefix of the same length it recomputes; load cost per block.

    python benchmarks/kv_host_tier.py [--conversations 40 --turns 6]
    python benchmarks/kv_host_tier.py --skip-costs --skip-multi-turn --shared-url redis://127.0.0.1:6379/0 \
        --prefix-tokens 2000
"""

from __future__ import annotations

import argparse
import math
import random
import uuid
import statistics
import threading
import time
from pathlib import Path

from services.bench.foreign_cpu import ForeignCpu
from services.common.env import read_settings
from services.common.models.loading import resolve_model_dir
from services.common.sampling_params import SamplingConfig
from services.target.config import EngineConfig
from services.target.engine.engine import Engine


def run(engine: Engine, prompt_ids: list[int], max_tokens: int) -> tuple[float, list[int], int, int, int]:
    """(TTFT seconds, output tokens, cached prompt tokens, of those from the host tier, and from the
    shared tier) of one request."""
    first, tokens, done, info = [], [], threading.Event(), {}

    def emit(out):
        if out.token_ids and not first:
            first.append(time.perf_counter())
        tokens.extend(out.token_ids)
        if out.finish_reason is not None:
            info.update(cached=out.cached_prompt_tokens, host=out.host_cached_prompt_tokens,
                        shared=out.shared_cached_prompt_tokens, error=out.error)
            done.set()
    start = time.perf_counter()
    engine.submit(f"bench-{time.monotonic_ns()}-{random.random()}", prompt_ids,
                  SamplingConfig(max_tokens=max_tokens, temperature=0.0), emit)
    done.wait()
    if info["error"] is not None:
        raise info["error"]
    return first[0] - start, tokens, info["cached"], info["host"], info["shared"]


def warm_up(engine: Engine) -> None:
    """One short request first, so that no measured request pays an engine's first-call costs."""
    run(engine, document(engine.tokenizer, 4 * engine.blocks.block_size + 3, 0), 2)


def document(tokenizer, num_tokens: int, salt: int) -> list[int]:
    words = [f"item{salt}-{i} is stored on shelf {i % 37} in room {i % 11}." for i in range(num_tokens)]
    return tokenizer(" ".join(words)).input_ids[:num_tokens]


def per_block_costs(model_dir: Path, prefix_tokens: int, block_size: int) -> None:
    blocks = prefix_tokens // block_size
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype="bfloat16", block_size=block_size,
                                      num_blocks=blocks + 8, max_batched_tokens=512))
    engine.start()
    try:
        warm_up(engine)
        tok = engine.tokenizer
        prefix, other = document(tok, prefix_tokens, 1), document(tok, prefix_tokens, 2)
        cold, cold_out, _, _, _ = run(engine, prefix, 8)  # recomputed: nothing cached
        run(engine, other, 1)  # evicts the prefix's blocks into the host tier
        before = engine.stats()
        warm, warm_out, cached, host, _ = run(engine, prefix, 8)
        after = engine.stats()
    finally:
        engine.shutdown()
    restored = after.host_tier_restored_blocks - before.host_tier_restored_blocks
    restore_s = after.host_tier_restore_seconds - before.host_tier_restore_seconds
    store_s = before.host_tier_store_seconds / max(before.host_tier_stored_blocks, 1)
    print(f"\n1. per block ({block_size} tokens, {engine.runner.kv_block_bytes} bytes), prefix {prefix_tokens} tokens")
    print(f"   TTFT recompute {cold * 1000:8.1f} ms   restored from the host tier {warm * 1000:8.1f} ms "
          f"({cached} cached, {host} from the host tier; same tokens: {cold_out == warm_out})")
    print(f"   recompute per block {cold / blocks * 1000:7.3f} ms   restore per block "
          f"{restore_s / max(restored, 1) * 1000:7.3f} ms (check + copy)   store per block {store_s * 1000:7.3f} ms")


def cross_replica(model_dir: Path, prefix_tokens: int, block_size: int, url: str) -> None:
    """Replica B's TTFT for a prefix replica A computed (loaded from the shared tier) against
    B's TTFT for a same-length prefix it recomputes; both engines in this process, one Redis."""
    import redis
    key_prefix = f"specmesh-bench:{uuid.uuid4().hex}"
    config = EngineConfig(model_dir=model_dir, dtype="bfloat16", block_size=block_size,
                          num_blocks=prefix_tokens // block_size + 16, max_batched_tokens=512,
                          kv_shared_url=url, kv_shared_prefix=key_prefix)
    a, b = Engine.load(config), Engine.load(config)
    for engine in (a, b):
        engine.start()
        warm_up(engine)
    try:
        tok = a.tokenizer
        shared_doc, local_doc = document(tok, prefix_tokens, 3), document(tok, prefix_tokens, 4)
        computed_on_a, a_out, _, _, _ = run(a, shared_doc, 8)
        a.blocks.shared_tier.flush(120.0)
        recompute = run(b, local_doc, 8)[0]  # B computes a prefix nobody has
        start = time.perf_counter()
        loaded_blocks = b.prefetch_shared(shared_doc)  # what the target's Generate does before submit
        prefetch_s = time.perf_counter() - start
        loaded, b_out, cached, _, shared_tokens = run(b, shared_doc, 8)
        s = b.stats()
    finally:
        for engine in (a, b):
            engine.shutdown()
        client = redis.Redis.from_url(url)
        for key in client.scan_iter(f"{key_prefix}:*"):
            client.delete(key)
        client.close()
    blocks = prefix_tokens // block_size
    print(f"\n3. cross-replica: prefix {prefix_tokens} tokens computed on A ({computed_on_a * 1000:.1f} ms TTFT), "
          f"{loaded_blocks} blocks loaded by B")
    print(f"   B TTFT recompute {recompute * 1000:8.1f} ms   from the shared tier {(prefetch_s + loaded) * 1000:8.1f} ms "
          f"(prefetch {prefetch_s * 1000:.1f} ms; {cached} cached, {shared_tokens} from the shared tier; "
          f"same tokens as A: {a_out == b_out})  ratio {recompute / (prefetch_s + loaded):.2f}x")
    print(f"   per block: recompute {recompute / blocks * 1000:7.3f} ms   load {s.shared_tier_load_seconds / max(s.shared_tier_loaded_blocks, 1) * 1000:7.3f} ms "
          f"(fetch + check)   restore {s.host_tier_restore_seconds / max(s.shared_tier_restored_blocks, 1) * 1000:7.3f} ms")


def conversation_prompts(tok, conversations: int, turns: int, facts: int = 40) -> list[list[list[int]]]:
    """Per conversation: its system message (with `facts` background facts: ~450 tokens at 40 with
    Gemma 3's tokenizer), then per turn the user message's tokens (the history is built as
    answers come)."""
    rng = random.Random(0)
    topics = ["the harbour", "a recipe", "old maps", "train timetables", "a garden", "the weather"]
    out = []
    for c in range(conversations):
        system = tok(f"Conversation {c}. You are a helpful assistant who answers in two sentences. "
                     f"Background: {' '.join(f'fact {c}-{i} about {rng.choice(topics)}.' for i in range(facts))}"
                     ).input_ids
        turns_ids = [tok(f" User: question {t} about {rng.choice(topics)}, please explain. Assistant:",
                         add_special_tokens=False).input_ids for t in range(turns)]
        out.append([system] + turns_ids)
    return out


def arrival_schedule(turns: list[int], rate: float, think: float, seed: int = 1,
                     ) -> tuple[list[float], list[list[float]]]:
    """Per conversation (of `turns[c]` turns): its start (Poisson arrivals at `rate` per second) and
    the pause before each turn (0 before the first; exponential of mean `think` seconds, 0 when
    `think` is 0); seeded, so both sides of the comparison replay the same schedule."""
    rng = random.Random(seed)
    starts, t = [], 0.0
    for _ in turns:
        t += rng.expovariate(rate) if math.isfinite(rate) else 0.0  # inf: all at once
        starts.append(t)
    pauses = [[rng.expovariate(1.0 / think) if think > 0 else 0.0 for _ in range(n)] for n in turns]
    for conv in pauses:
        conv[0] = 0.0  # a first turn comes at the conversation's start
    return starts, pauses


def side_config(model_dir: Path, args, num_blocks: int, host_bytes: int) -> EngineConfig:
    """One side's engine: the same pool, seats and token budget on both, the tier or none."""
    return EngineConfig(model_dir=model_dir, dtype=args.dtype, block_size=args.block_size, num_blocks=num_blocks,
                        max_batched_tokens=512, max_num_seqs=16, kv_host_bytes=host_bytes)


def calibrated_rate(config: EngineConfig, convs, max_tokens: int, load: float) -> float:
    """Conversations per second at `load` of what the host-tier side completes at saturation: every
    conversation arriving at once (all turns, on an engine configured as that side's), the count over
    the time until the last answer. The rate the comparison runs at is then one the side with the tier
    serves without a standing queue, while the side without it, which recomputes each history, may
    not: the capacity the tier adds is what the comparison shows. (A rate from first turns alone, or a
    fixed rate, left the tier side saturated on slower machines, and both sides' tails were then queue.)"""
    engine = Engine.load(config)
    engine.start()
    try:
        warm_up(engine)
        start = time.perf_counter()
        ttfts, _, _ = multi_turn(engine, convs, max_tokens, rate=math.inf)
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    capacity = len(convs) / seconds
    print(f"   calibrated rate: the host-tier side served {len(convs)} conversations arriving at once in "
          f"{seconds:.1f} s ({capacity:.3f} conversations/s at saturation; TTFT there "
          f"{ttft_summary(list(ttfts.values())).strip()}) -> {load:.0%} of it: {load * capacity:.3f} conversations/s")
    return load * capacity


def multi_turn(engine: Engine, convs, max_tokens: int, rate: float, think: float = 0.0, seed: int = 1):
    """Runs every conversation (turns in order, each on its whole history) with Poisson arrivals
    and, between an answer and the next user turn, an exponential think time of mean `think`
    seconds (the same draws on both sides); returns (TTFTs per (conversation, turn), outputs per
    conversation and turn, cached tokens, host-tier tokens)."""
    starts, pauses = arrival_schedule([len(conv) - 1 for conv in convs], rate, think, seed)
    ttfts, outputs, totals, lock = {}, {}, [0, 0], threading.Lock()
    origin = time.perf_counter()

    def converse(c: int) -> None:
        time.sleep(max(0.0, starts[c] - (time.perf_counter() - origin)))
        history = list(convs[c][0])
        for turn, user in enumerate(convs[c][1:]):
            time.sleep(pauses[c][turn])
            history += user
            first, answer, cached, host, _ = run(engine, history, max_tokens)
            history += answer
            with lock:
                ttfts[c, turn] = first
                outputs[c, turn] = answer
                totals[0] += cached
                totals[1] += host
    threads = [threading.Thread(target=converse, args=(c,)) for c in range(len(convs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return ttfts, outputs, totals


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ttft_summary(values: list[float]) -> str:
    return (f"P50 {statistics.median(values) * 1000:8.1f} ms  P99 {percentile(values, 0.99) * 1000:8.1f} ms"
            if values else "none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--system-facts", type=int, default=40, help="background facts in each conversation's "
                        "system message (40: ~450 tokens, 70% of a 6-turn conversation's final history)")
    parser.add_argument("--rate", default="auto", help="conversations arriving per second, or 'auto': --load "
                        "times what the host-tier side serves at saturation, measured first (calibrated_rate)")
    parser.add_argument("--load", type=float, default=0.6, help="with --rate auto: the share of the host-tier "
                        "side's measured capacity offered to both sides")
    parser.add_argument("--think", type=float, default=0.0, help="mean seconds between an answer and the "
                        "conversation's next turn (exponential; 0: the next turn at once, as an agent loop)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the engines' dtype in the multi-turn part (float32: outputs comparable token for token)")
    parser.add_argument("--skip-costs", action="store_true")
    parser.add_argument("--skip-multi-turn", action="store_true")
    parser.add_argument("--shared-url", default="", help="Redis URL: also measure the cross-replica "
                        "load from the shared tier (keys under a fresh prefix, deleted after)")
    parser.add_argument("--without-first", action="store_true", help="run without the tier first "
                        "(on a shared machine, swap the order to see the drift)")
    args = parser.parse_args()
    with ForeignCpu() as cpu:  # CPU used by anything outside this process meanwhile
        measure(args, cpu)
    foreign = cpu.share()
    print(f"\nforeign CPU while measuring: median {100 * (foreign['median'] or 0):.1f}%, "
          f"max {100 * (foreign['max'] or 0):.1f}% ({foreign['samples']} samples)"
          + ("  VOID: another process used the machine" if foreign["void"] else ""))


def foreign_since(cpu: ForeignCpu, start: float) -> str:
    """The foreign CPU share of one part of the run (each side is measured under its own load)."""
    share = cpu.share(start)
    return (f"foreign CPU median {100 * (share['median'] or 0):.1f}%, max {100 * (share['max'] or 0):.1f}%"
            + (" VOID" if share["void"] else ""))


def measure(args, cpu: ForeignCpu) -> None:
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    if not args.skip_costs:
        start = time.monotonic()
        per_block_costs(model_dir, args.prefix_tokens, args.block_size)
        print(f"   {foreign_since(cpu, start)}")
    if args.shared_url:
        start = time.monotonic()
        cross_replica(model_dir, args.prefix_tokens, args.block_size, args.shared_url)
        print(f"   {foreign_since(cpu, start)}")
    if args.skip_multi_turn:
        return
    probe = Engine.load(EngineConfig(model_dir=model_dir, dtype=args.dtype, num_blocks=256))
    convs = conversation_prompts(probe.tokenizer, args.conversations, args.turns, args.system_facts)
    probe.shutdown()
    # Working set: every conversation's final history (system, user turns, answers at most max_tokens).
    working = sum(sum(len(p) for p in conv) + args.turns * args.max_tokens for conv in convs)
    longest = max(sum(len(p) for p in conv) + args.turns * args.max_tokens for conv in convs)
    num_blocks = max(working // args.block_size // 4, 2 * longest // args.block_size + 8)
    print(f"\n2. multi-turn: {args.conversations} conversations x {args.turns} turns, working set {working} "
          f"tokens, device pool {num_blocks} blocks of {args.block_size} "
          f"({num_blocks * args.block_size / working:.0%} of it), think time {args.think:g} s mean, {args.dtype}")
    if args.rate == "auto":
        start = time.monotonic()
        args.rate = calibrated_rate(side_config(model_dir, args, num_blocks, 1 << 30), convs, args.max_tokens,
                                    args.load)
        print(f"   {foreign_since(cpu, start)}")
    else:
        args.rate = float(args.rate)
    print(f"   both sides: {args.rate:.3g}/s Poisson arrivals")
    results, queues = {}, {}
    sides = [("host tier", 1 << 30), ("no host tier", 0)]
    for label, host_bytes in (sides[::-1] if args.without_first else sides):
        engine = Engine.load(side_config(model_dir, args, num_blocks, host_bytes))
        engine.start()
        try:
            warm_up(engine)
            before, start = engine.stats(), time.monotonic()
            results[label] = multi_turn(engine, convs, args.max_tokens, args.rate, args.think)
            s = engine.stats()
            queues[label] = [f.admitted - f.arrival for f in engine.step_log.snapshot()[1] if f.arrival >= start]
        finally:
            engine.shutdown()
        ttfts, _, (cached, host) = results[label]
        print(f"   {label:13s} TTFT {ttft_summary(list(ttfts.values()))}   cached prompt tokens {cached} "
              f"({host} from the host tier)")
        print(f"   {'':13s} first turns {ttft_summary([v for (_, t), v in ttfts.items() if t == 0])}; later turns "
              f"{ttft_summary([v for (_, t), v in ttfts.items() if t > 0])}; of TTFT, queue wait {ttft_summary(queues[label])}")
        print(f"   {'':13s} prompt tokens computed {s.prompt_tokens_computed - before.prompt_tokens_computed}, "
              f"preemptions {s.num_preemptions - before.num_preemptions} ({s.swap_preemptions} swapped), "
              f"evictions {s.evictions - before.evictions}, host tier: {s.host_tier_stored_blocks} stored "
              f"({s.host_tier_store_seconds:.2f} s), {s.host_tier_restored_blocks} restored "
              f"({s.host_tier_restore_seconds:.2f} s), {s.host_tier_dropped_blocks} dropped; "
              f"{time.monotonic() - start:.0f} s, {foreign_since(cpu, start)}")
    a, b = results["host tier"][1], results["no host tier"][1]
    same = sum(a[k] == b[k] for k in a)
    with_tier, without = list(results["host tier"][0].values()), list(results["no host tier"][0].values())
    p50 = statistics.median(without) / statistics.median(with_tier)
    p99 = percentile(without, 0.99) / percentile(with_tier, 0.99)
    print(f"   TTFT without / with the host tier: P50 {p50:.2f}x  P99 {p99:.2f}x;  "
          f"same outputs in {same} of {len(a)} turns")
    # A conversation whose answers part at some turn had the same history on both sides up to
    # there: the parting is the KV's rounding (bf16 restored as computed vs recomputed in other
    # chunks), and every later turn of it differs because its history does.
    first = [min((t for t in range(args.turns) if a[c, t] != b[c, t]), default=None) for c in range(len(convs))]
    parted = [t for t in first if t is not None]
    print(f"   conversations whose answers part: {len(parted)} of {len(convs)}, at turns {sorted(parted)}; "
          f"turns after the first parting: {sum(args.turns - 1 - t for t in parted)}")


if __name__ == "__main__":
    main()
