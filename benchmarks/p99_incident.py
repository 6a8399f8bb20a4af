"""The seed's P99 incident: speculation raises the mean and hurts the tail of some buckets.

    python benchmarks/p99_incident.py                  # default model, calibrated load
    python benchmarks/p99_incident.py --model tiny --num-requests 40

One target (+ draft service) in this process; three routers in front of it, one after the
other, each sending the same open-loop Poisson schedule (same seed) of a mixed workload:
high-acceptance buckets (summarize a given text, code edit, QA over a given text) and
low-acceptance ones (creative writing at temperature 1, tool-agent-like 6-token outputs),
at a load near saturation (a fraction of the measured no-speculation capacity):

- off:      no speculation,
- fixed:    prompt lookup at a fixed depth for every request,
- adaptive: the router's per-bucket prediction + measured acceptance, and the target's
            load-aware depth per step (services/router/speculation_policy.py).

Each router first serves a warm-up schedule (so the adaptive one has measured its buckets),
then the measured one, in `--rounds` parts with the arms taking turns (machine-load drift
then hits every arm alike). Writes docs/p99_incident.{json,md,png}. Ratios are what to read:
these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.bench.foreign_cpu import ForeignCpu  # noqa: E402
from services.bench.report import ALL, Slo, summarize  # noqa: E402
from services.bench.runner import run_schedule  # noqa: E402
from services.bench.schedule import poisson_schedule  # noqa: E402
from services.bench.workload import WorkloadItem  # noqa: E402
from services.common.server import ServerConfig  # noqa: E402
from services.router.app import build_router_server  # noqa: E402
from services.router.config import RouterConfig  # noqa: E402
from services.target.server.app import build_target_server  # noqa: E402
from services.target.config import EngineConfig  # noqa: E402
from services.target.engine.engine import Engine  # noqa: E402
from services.target.engine.step_log import decode_breakdown, first_token_breakdown  # noqa: E402
from services.bench.foreign_cpu import VOID_SHARE  # noqa: E402
from specmesh.client import NO_RETRIES, AsyncClient  # noqa: E402
from tests.mesh import TOKEN_A, start_draft  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ARMS = {"off": {"speculation_method": "off"},
        "fixed": {"speculation_method": "prompt_lookup", "speculation_policy": "fixed"},
        "adaptive": {"speculation_method": "prompt_lookup", "speculation_policy": "adaptive"},
        # A second no-speculation arm, only when asked (--arms off off_again adaptive): its ratio
        # to off is the benchmark's own noise floor (near saturation two 60 s rounds of arms
        # that both never drafted differed by up to 1.5x in a bucket's P99 TTFT).
        "off_again": {"speculation_method": "off"}}
DEFAULT_ARMS = ("off", "fixed", "adaptive")

_TEXT = ("The city council met on Tuesday to discuss the new public library. The library will be "
         "built on the site of the old train station, which has been empty for ten years. "
         "Construction will start in March and is expected to take two years. The council approved "
         "a budget of twelve million dollars, of which four million will come from a state grant.")
_CODE = ("def total(items):\n    result = 0\n    for item in items:\n        result = result + item.price\n"
         "    return result\n")


def workload() -> list[WorkloadItem]:
    high = [WorkloadItem("summarize", f"Summarize the following text.\n\n{_TEXT}\n\nSummary:", 48),
            WorkloadItem("code_edit", f"Rename the variable result to acc in this code.\n\n{_CODE}\nNew code:\n", 48),
            WorkloadItem("qa", f"{_TEXT}\n\nQuestion: where will the library be built? Answer with the "
                         "sentence from the text.\nAnswer:", 32)]
    low = [WorkloadItem("creative", "Write a short poem about the sea at night.", 48, temperature=1.0),
           WorkloadItem("tool", "Call the weather tool for Paris. Reply with JSON only:", 6)]
    return high + low


async def main() -> None:
    args = _args()
    if args.from_json:
        rerender(args.from_json)
        return
    from services.common.models.loading import resolve_model_dir
    if args.model == "tiny":
        from services.common.models.tiny import build_tiny_model
        model_dir = build_tiny_model(Path("/tmp/specmesh-p99-tiny"), arch="llama", seed=0)
    else:
        model_dir = resolve_model_dir(args.model, Path.home() / ".cache" / "specmesh" / "models")
    draft = await start_draft()
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                      max_batched_tokens=256, num_blocks=4096, block_size=16,
                                      draft_address=draft.address))
    target = build_target_server(ServerConfig(port=0), engine, "bench")
    await target.start()
    while not engine.speculator.client.connected:
        await asyncio.sleep(0.05)
    items = workload()
    cpu = ForeignCpu()  # this process holds the whole mesh: everything else is foreign
    try:
        with cpu:
            qps = args.qps or await calibrate(target.address, items, args)
            arms = {arm: plan for arm, plan in ARMS.items() if arm in (args.arms or DEFAULT_ARMS)}
            results = await run_rounds(target.address, items, arms, qps, args, cpu)
            if not args.qps:  # the machine must be the one calibrated: capacity again, after
                args.capacity_before = args.capacity
                await calibrate(target.address, items, args)
                args.capacity_after = args.capacity
        attach_breakdowns(results, engine)
        attach_foreign(results, cpu)
        args.step_cost = step_cost(engine)
        for arm, result in results.items():
            print(_line(arm, result), flush=True)
    finally:
        await target.stop(grace=1)
        await draft.stop(grace=0)
    args.foreign_cpu = cpu.share()
    verdict = validity(args)
    write(results, qps, args, verdict)
    if verdict:
        print(f"VOID: {verdict}", flush=True)
        sys.exit(3)


DRIFT = 0.15  # capacity after the arms may differ this much from before


def validity(args) -> str:
    """Why the run is void ("" when it is not): foreign CPU above the bound, or capacity
    measured after the arms off by more than DRIFT from before (the load offered was then
    not the fraction of capacity the run says)."""
    problems = []
    if args.foreign_cpu["void"]:
        problems.append(f"median foreign CPU {args.foreign_cpu['median']:.1%} of the machine "
                        f"(bound {VOID_SHARE:.0%})")
    before, after = getattr(args, "capacity_before", None), getattr(args, "capacity_after", None)
    if before and after and abs(after / before - 1) > DRIFT:
        problems.append(f"capacity drifted from {before:.2f} to {after:.2f} req/s during the run")
    return "; ".join(problems)


def attach_breakdowns(results: dict, engine) -> None:
    """Joins each request with the engine's step log (same process, same monotonic clock):
    where its first-token time went — the router on the way in, queue, the steps it waited
    through and what they carried, the way back out — and what the steps of its decoding
    carried (services/target/engine/step_log.py)."""
    steps, firsts = engine.step_log.snapshot()
    steps.sort(key=lambda s: s.start)
    by_id = {f.request_id: f for f in firsts}
    for result in results.values():
        for record in result["requests"]:
            first = by_id.get(record.get("request_id"))
            if first is None or record.get("first_token_monotonic") is None:
                continue
            record.update(first_token_breakdown(first, steps),
                          router_in_s=first.arrival - record["sent_monotonic"],
                          out_s=record["first_token_monotonic"] - first.first_token)
            if record.get("e2e_s") is not None:
                record.update(decode_breakdown(first.first_token, record["sent_monotonic"] + record["e2e_s"], steps))


def step_cost(engine) -> dict | None:
    """The step cost model the target fitted on this machine by the end of the run (what its
    per-step depth was priced with) and its draft call's moving mean, in ms."""
    load = engine.speculator.load if engine.speculator is not None else None
    fit = load.cost.coefficients() if load is not None else None
    if fit is None:
        return None
    names = ("step_ms", "per_token_ms", "per_logit_row_ms", "per_tree_ms")
    return {k: round(1e3 * v, 3) for k, v in zip(names, fit)} | {
        "draft_call_ms": round(1e3 * (load.draft_seconds or 0.0), 3)}


DISTURBED = 0.20  # a one-second sample with more foreign CPU than this disturbed the requests it overlaps


def attach_foreign(results: dict, cpu: ForeignCpu) -> None:
    """Each request's worst one-second foreign CPU share over its life (send to last token):
    a tail made by another process shows here, not in the run's median."""
    samples = sorted(cpu.samples)
    ends = [t for t, _ in samples]
    for result in results.values():
        for record in result["requests"]:
            if record.get("e2e_s") is None:
                continue
            start, end = record["sent_monotonic"], record["sent_monotonic"] + record["e2e_s"]
            lo, hi = bisect.bisect_left(ends, start), bisect.bisect_left(ends, end + cpu.interval_s)
            record["foreign_max"] = max((v for _, v in samples[lo:hi]), default=0.0)


async def calibrate(address: str, items, args, bursts: int = 3) -> float:
    """Capacity without speculation: a burst of requests all at once, completed per second;
    the median of `bursts` bursts after a discarded first one. A fresh engine's first steps
    are slow, and on a shared machine one burst can stall for seconds (measured here: bursts
    of one engine ranged 0.8-6.4 req/s), which alone would set the load at a fraction of
    saturation. Each burst is its own draw of the mix, six batches deep: bursts of two batches
    drawn once and repeated read 6.0 req/s where the off arm then served about 4.5 under
    Poisson arrivals (a draw light in long requests, measured again and again)."""
    size = args.max_num_seqs * 6
    warm = poisson_schedule(1000.0, args.seed + 99, len(items), num_requests=args.max_num_seqs * 2)
    await _serve(address, items, ARMS["off"], warm, args)  # a fresh engine's first steps are slow
    capacities = []
    for b in range(bursts):
        burst = poisson_schedule(1000.0, args.seed + 100 + b, len(items), num_requests=size)
        records = await _serve(address, items, ARMS["off"], burst, args)
        capacities.append(len(records) / max(r.sent_s + (r.e2e_s or 0) for r in records))
    capacity = sorted(capacities)[len(capacities) // 2]
    print(f"capacity without speculation ~{capacity:.2f} req/s (median of "
          f"{', '.join(f'{c:.2f}' for c in capacities)}); offering {args.load:.0%} of it", flush=True)
    args.capacities, args.capacity = capacities, capacity
    return capacity * args.load


async def run_rounds(address: str, items, arms: dict, qps: float, args, cpu: ForeignCpu) -> dict:
    """Each arm's router serves a warm-up schedule, then the measured requests in `--rounds`
    parts, the arms taking turns per part in an order rotated each round (`round_order`): a change in the
    machine's load during the run then hits every arm alike. Part r is the same Poisson
    schedule (seed + 1000·r) for every arm; the routers (and their measurements) live on."""
    if args.round_seconds:  # rounds of about that many seconds of arrivals, as many as fit
        per_round = max(4, round(qps * args.round_seconds))
        sizes = [min(per_round, args.num_requests - k) for k in range(0, args.num_requests, per_round)]
    else:
        sizes = [args.num_requests // args.rounds + (r < args.num_requests % args.rounds) for r in range(args.rounds)]
    routers, records, durations, walls = {}, {a: [] for a in arms}, dict.fromkeys(arms, 0.0), dict.fromkeys(arms, 0.0)
    windows = {a: [] for a in arms}  # (start, end) monotonic of each of the arm's rounds
    try:
        for arm, plan in arms.items():
            routers[arm] = await _start_router(address, plan, args)
            warmup = poisson_schedule(qps, args.seed + 1, len(items), num_requests=args.warmup)
            if warmup:
                await _send(routers[arm], items, warmup)
        started = time.perf_counter()
        for r, size in enumerate(sizes):
            elapsed = time.perf_counter() - started
            if args.minutes and r and elapsed * (r + 1) / r > args.minutes * 60:
                print(f"stopping after {r} rounds: another would pass --minutes {args.minutes}", flush=True)
                break
            schedule = poisson_schedule(qps, args.seed + 1000 * r, len(items), num_requests=size)
            for arm in round_order(list(arms), r):
                start, window_start = time.perf_counter(), time.monotonic()
                part = await _send(routers[arm], items, schedule)
                windows[arm].append((window_start, time.monotonic()))
                walls[arm] += time.perf_counter() - start
                durations[arm] += max(x.sent_s + (x.e2e_s or 0) for x in part)
                records[arm] += [(r, x) for x in part]
                print(f"round {r + 1}/{len(sizes)} {arm}: {len(part)} requests, "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
    finally:
        for router in routers.values():
            await router.stop(grace=1)
    results = {}
    for arm, plan in arms.items():
        requests = [x.to_json() | {"round": r} for r, x in records[arm]]
        foreign = [v for t, v in cpu.samples if any(a <= t <= b for a, b in windows[arm])]
        results[arm] = {"plan": plan, "qps": qps, "duration_s": durations[arm], "wall_s": walls[arm],
                        "requests": requests, "summary": summarize(requests, durations[arm], Slo()),
                        "foreign_cpu": sorted(foreign)[len(foreign) // 2] if foreign else None}
    return results


def round_order(arms: list[str], r: int) -> list[str]:
    """The order the arms take their turns in round r: rotated by one each round, so no arm is
    always first (after the calibration) or always last. In a fixed order, an A/A run at 85%
    (off, adaptive, off_again per round) had off_again, always last, at 0.61-0.80x off's P99
    TTFT in every bucket and 12% better mean TPOT, with identical settings."""
    k = r % len(arms) if arms else 0
    return arms[k:] + arms[:k]


async def _start_router(address: str, plan: dict, args):
    router = build_router_server(ServerConfig(port=0), RouterConfig(
        target_address=address, tokens={TOKEN_A: "bench"}, max_tokens_limit=1024,
        speculation_depth=args.depth, **plan))
    await router.start()
    return router


async def _send(router, items, schedule):
    client = AsyncClient(router.address, retry=NO_RETRIES)  # a retry would hide a failure
    try:
        return await run_schedule(client, items, schedule, TOKEN_A, timeout_s=600)
    finally:
        await client.close()


async def _serve(address: str, items, plan: dict, schedule, args):
    router = await _start_router(address, plan, args)
    try:
        return await _send(router, items, schedule)
    finally:
        await router.stop(grace=1)


def write(results: dict, qps: float, args, verdict: str = "") -> None:
    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    name = f"p99_incident{args.tag}"
    arms = {a: {k: v for k, v in r.items() if k != "requests"} | {"records": _records(r["requests"])}
            for a, r in results.items()}
    (docs / f"{name}.json").write_text(json.dumps(
        {"qps": qps, "args": vars(args), "code": _code_state(), "void": verdict, "arms": arms}, indent=1))
    (docs / f"{name}.md").write_text(markdown(results, qps, args, verdict))
    if "off" in results:
        plot(results, docs / f"{name}.png", qps, args)
    print(f"wrote {docs / name}.md")


RECORD_FIELDS = ("round", "bucket", "sent_s", "ttft_s", "tpot_s", "e2e_s", "completion_tokens", "rejected_tokens",
                 # where the first token's time went (attach_breakdowns)
                 "router_in_s", "queue_s", "engine_s", "out_s", "steps", "steps_with_prefill",
                 "steps_with_verify", "verify_step_s", "draft_call_s", "draft_nodes", "max_waiting",
                 # what the steps of its decoding carried (mean per step), and other load during its life
                 "decode_steps", "decode_step_s", "decode_rows", "decode_prefill_tokens", "decode_draft_nodes",
                 "decode_draft_s", "foreign_max")
# The tail table: mean of these over each arm's slowest first tokens.
TAIL_FIELDS = ("ttft_s", "router_in_s", "queue_s", "engine_s", "out_s", "steps", "steps_with_verify",
               "verify_step_s", "draft_call_s", "draft_nodes", "max_waiting")
# The TPOT tail table: the same over each arm's slowest times per output token.
TPOT_TAIL_FIELDS = ("tpot_s", "decode_steps", "decode_step_s", "decode_rows", "decode_prefill_tokens",
                    "decode_draft_nodes", "decode_draft_s", "foreign_max")


def _records(requests: list[dict]) -> dict:
    """Per-request rows (compact), so tails can be re-examined and resampled later."""
    def cell(v):
        return round(v, 5) if isinstance(v, float) else v
    return {"fields": RECORD_FIELDS, "rows": [[cell(x.get(f)) for f in RECORD_FIELDS] for x in requests]}


def _code_state() -> dict:
    """The commit measured, and whether the tree differed from it (other sessions edit it)."""
    import subprocess

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.rstrip()
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--untracked-files=no", "services", "benchmarks").splitlines()}


def p99_ratio_interval(arm: list[float], off: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """90% bootstrap interval of P99(arm) / P99(off): each arm's requests resampled with
    replacement. With ~170 requests a bucket, P99 is about the 2nd-3rd largest value, so a
    single stalled step moves it; the interval says how far."""
    import numpy as np
    rng = np.random.default_rng(seed)
    a, o = np.asarray(arm), np.asarray(off)
    ratios = (np.percentile(rng.choice(a, (draws, len(a))), 99, axis=1)
              / np.percentile(rng.choice(o, (draws, len(o))), 99, axis=1))
    low, high = np.percentile(ratios, [5, 95])
    return float(low), float(high)


def round_block_interval(arm: list[dict], off: list[dict], metric: str, draws: int = 2000,
                         seed: int = 0) -> tuple[float, float] | None:
    """90% interval of P99(arm) / P99(off) resampling whole rounds (paired: round r is the
    same schedule in both arms), then requests within them. Near saturation a round's queue
    moves every request in it together (measured: one arm's P99 TTFT 0.14 s in one round and
    1.6 s in another), so resampling requests alone understates the noise. None with < 2 rounds."""
    import numpy as np
    rounds = sorted({x["round"] for x in arm} & {x["round"] for x in off})
    if len(rounds) < 2:
        return None
    by = lambda rs, r: np.asarray([x[metric] for x in rs if x["round"] == r and x[metric] is not None])  # noqa: E731
    a, o = {r: by(arm, r) for r in rounds}, {r: by(off, r) for r in rounds}
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(draws):
        pick = rng.choice(rounds, len(rounds))
        mine = np.concatenate([rng.choice(a[r], len(a[r])) for r in pick if len(a[r])])
        base = np.concatenate([rng.choice(o[r], len(o[r])) for r in pick if len(o[r])])
        ratios.append(np.percentile(mine, 99) / np.percentile(base, 99))
    low, high = np.percentile(ratios, [5, 95])
    return float(low), float(high)


def per_round(results: dict) -> list[str]:
    """P99 TTFT and TPOT over all buckets, per round and arm: how far rounds alone move the tail."""
    import numpy as np
    if "off" not in results:
        return []
    lines = ["P99 over all buckets per round (ms; the same arrival schedule in every arm of a round):", "",
             "| round | " + " | ".join(f"{arm} TTFT | {arm} TPOT" for arm in results) + " |",
             "|---|" + "---:|---:|" * len(results)]
    rounds = sorted({x["round"] for x in results["off"]["requests"]})
    for r in rounds:
        cells = []
        for result in results.values():
            for metric in ("ttft_s", "tpot_s"):
                v = [x[metric] for x in result["requests"] if x["round"] == r and x[metric] is not None]
                cells.append(f"{np.percentile(v, 99) * 1000:.0f}" if v else "-")
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return lines


def markdown(results: dict, qps: float, args, verdict: str = "") -> str:
    off = results["off"]["summary"] if "off" in results else next(iter(results.values()))["summary"]
    load = f"{args.load:.0%} of measured capacity" if args.qps is None else "given with --qps"
    lines = [f"# P99 incident: model `{args.model}`, {qps:.3f} req/s ({load}), "
             f"{len(next(iter(results.values()))['requests'])} requests per arm after {args.warmup} warm-up, "
             f"in rounds (arms taking turns), seed {args.seed}", "",
             *([f"**VOID: {verdict}.** No ratio below may be quoted.", ""] if verdict else []),
             *calibration(results, args), "",
             "P99 in ms; in brackets the ratio to no speculation (> 1.05 = more than 5% worse).", "",
             "| bucket | arm | TTFT P99 | TPOT P99 | TPOT mean | e2e P99 | accept. length | rejected tok |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for bucket in off:
        for arm, result in results.items():
            s = result["summary"].get(bucket)
            if s is None:
                continue
            lines.append(f"| {bucket} | {arm} | {_cell(s, off[bucket], 'ttft_s')} | {_cell(s, off[bucket], 'tpot_s')} "
                         f"| {_ms(s['tpot_s']['mean'])} | {_cell(s, off[bucket], 'e2e_s')} "
                         f"| {s['acceptance_length']:.2f} | {s['rejected_tokens']} |")
    lines += ["", "Output tokens per second over the measured window (all buckets):", ""]
    for arm, result in results.items():
        tokens = result["summary"][ALL]["completion_tokens"]
        lines.append(f"- {arm}: {tokens / result['duration_s']:.1f} tok/s, mean TPOT "
                     f"{_ms(result['summary'][ALL]['tpot_s']['mean'])} ms")
    lines += ["", *goal(results), "", *per_round(results), "", *tail_table(results), "",
              *tail_table(results, "tpot_s", TPOT_TAIL_FIELDS), "", *undisturbed(results)]
    return "\n".join(lines) + "\n"


def calibration(results: dict, args) -> list[str]:
    """The load calibration and the foreign CPU share, as the run measured them."""
    lines = []
    if getattr(args, "capacities", None):
        before = getattr(args, "capacity_before", args.capacity)
        after = getattr(args, "capacity_after", None)
        lines.append(f"Capacity without speculation: {before:.2f} req/s before the arms"
                     + (f", {after:.2f} after ({after / before - 1:+.0%}; void beyond ±{DRIFT:.0%})" if after else ""))
    share = getattr(args, "foreign_cpu", None) or {}
    if share.get("samples"):
        per_arm = ", ".join(f"{a} {r['foreign_cpu']:.1%}" for a, r in results.items() if r.get("foreign_cpu") is not None)
        lines.append(f"Foreign CPU (processes outside this one, share of the machine): median {share['median']:.1%}, "
                     f"max {share['max']:.1%} over {share['samples']} one-second samples; per arm (median) {per_arm}")
    cost = getattr(args, "step_cost", None)
    if cost:
        lines.append(f"Step cost the target fitted here (t = a + b·tokens + c·logit rows + e·trees): a {cost['step_ms']:.1f} ms, "
                     f"b {cost['per_token_ms']:.2f}, c {cost['per_logit_row_ms']:.2f}, e {cost['per_tree_ms']:.2f} ms; "
                     f"draft call {cost['draft_call_ms']:.2f} ms")
    return lines


def tail_table(results: dict, metric: str = "ttft_s", fields: tuple = TAIL_FIELDS, tail: float = 0.05) -> list[str]:
    """Where the slowest requests' time went: for each bucket's slowest `tail` by `metric`
    (at least 2 requests), the mean of each part, per arm (ms, steps, nodes, shares)."""
    what = {"ttft_s": "first tokens of each bucket waited", "tpot_s": "times per output token of each bucket went"}[metric]
    lines = [f"Where the slowest {tail:.0%} {what} (means over those requests; ms unless a count, "
             "decode_* per step of their decoding, foreign_max the worst one-second foreign CPU share in their life):", "",
             "| arm | " + " | ".join(fields) + " |", "|---|" + "---:|" * len(fields)]
    for arm, result in results.items():
        rows = []
        for bucket in {x["bucket"] for x in result["requests"]}:
            mine = sorted((x for x in result["requests"] if x["bucket"] == bucket and x.get(metric) is not None
                           and all(x.get(f) is not None for f in fields)), key=lambda x: x[metric])
            rows += mine[-max(2, round(len(mine) * tail)):] if mine else []
        if not rows:
            continue
        cells = []
        for f in fields:
            mean = sum(x[f] for x in rows) / len(rows)
            cells.append(f"{mean:.0%}" if f == "foreign_max" else f"{mean * 1000:.1f}" if f.endswith("_s") else f"{mean:.1f}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def goal(results: dict) -> list[str]:
    """The issue's goal per arm: the worst bucket's P99 TTFT and TPOT against no speculation
    (at most 1.05), and the share of fixed speculation's mean-TPOT gain it keeps."""
    if "off" not in results:
        return []
    off = results["off"]["summary"]
    gain = {arm: 1 - r["summary"][ALL]["tpot_s"]["mean"] / off[ALL]["tpot_s"]["mean"] for arm, r in results.items()}
    lines = ["Goal check (worst bucket's P99 ratio to off; mean-TPOT gain over off):", ""]
    for arm, result in results.items():
        if arm == "off":
            continue
        worst = {}
        for metric in ("ttft_s", "tpot_s"):
            ratios = {b: s[metric]["p99"] / off[b][metric]["p99"] for b, s in result["summary"].items()
                      if b != ALL and b in off and s[metric]["p99"] and off[b][metric]["p99"]}
            b = max(ratios, key=ratios.get)
            worst[metric] = f"{ratios[b]:.2f} ({b})"
        kept = f", {gain[arm] / gain['fixed']:.0%} of fixed's" if "fixed" in gain and arm != "fixed" and gain["fixed"] > 0 else ""
        lines.append(f"- {arm}: worst P99 TTFT {worst['ttft_s']}, worst P99 TPOT {worst['tpot_s']}; "
                     f"mean TPOT gain {gain[arm]:.0%}{kept}")
    lines += ["", "P99 ratio to off per bucket with its 90% bootstrap interval (requests resampled), and in "
              "braces resampling whole rounds, then requests (`round_block_interval`: the honest one near saturation):", "",
              "| bucket | arm | TTFT P99 ratio | TPOT P99 ratio |", "|---|---|---|---|"]
    for bucket in off:
        for arm, result in results.items():
            if arm == "off" or bucket not in result["summary"]:
                continue
            cells = []
            for metric in ("ttft_s", "tpot_s"):
                mine = [x[metric] for x in result["requests"] if _in(x, bucket) and x[metric] is not None]
                base = [x[metric] for x in results["off"]["requests"] if _in(x, bucket) and x[metric] is not None]
                if not mine or not base:
                    cells.append("-")
                    continue
                low, high = p99_ratio_interval(mine, base)
                ratio = result["summary"][bucket][metric]["p99"] / off[bucket][metric]["p99"]
                blocks = round_block_interval([x for x in result["requests"] if _in(x, bucket)],
                                              [x for x in results["off"]["requests"] if _in(x, bucket)], metric)
                block = f" {{{blocks[0]:.2f}, {blocks[1]:.2f}}}" if blocks else ""
                cells.append(f"{ratio:.2f} [{low:.2f}, {high:.2f}]{block}")
            lines.append(f"| {bucket} | {arm} | {cells[0]} | {cells[1]} |")
    return lines


def undisturbed(results: dict) -> list[str]:
    """The P99 ratios again over the requests no other process disturbed (no one-second sample
    of their life above DISTURBED foreign CPU), beside the count left out: a burst of other
    load hits whichever arm runs then, and with ~150 requests a bucket P99 is the 2nd-3rd
    worst. Read with the table above, not instead of it."""
    if "off" not in results:
        return []
    clean = {arm: [x for x in r["requests"] if x.get("foreign_max") is not None and x["foreign_max"] <= DISTURBED]
             for arm, r in results.items()}
    left = ", ".join(f"{arm} {len(r['requests']) - len(clean[arm])}" for arm, r in results.items())
    lines = [f"P99 ratio to off over undisturbed requests (left out, foreign CPU above {DISTURBED:.0%} "
             f"in some second of their life: {left}):", "",
             "| bucket | arm | TTFT P99 ratio | TPOT P99 ratio |", "|---|---|---|---|"]
    import numpy as np
    for bucket in results["off"]["summary"]:
        for arm in results:
            if arm == "off":
                continue
            cells = []
            for metric in ("ttft_s", "tpot_s"):
                mine = [x[metric] for x in clean[arm] if _in(x, bucket) and x[metric] is not None]
                base = [x[metric] for x in clean["off"] if _in(x, bucket) and x[metric] is not None]
                if len(mine) < 2 or len(base) < 2:
                    cells.append("-")
                    continue
                low, high = p99_ratio_interval(mine, base)
                cells.append(f"{np.percentile(mine, 99) / np.percentile(base, 99):.2f} [{low:.2f}, {high:.2f}]")
            lines.append(f"| {bucket} | {arm} | {cells[0]} | {cells[1]} |")
    return lines


def _in(record: dict, bucket: str) -> bool:
    return bucket == ALL or record["bucket"] == bucket


def plot(results: dict, path: Path, qps: float, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    buckets = [b for b in results["off"]["summary"]]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    width = 0.8 / len(results)
    for ax, metric, title in zip(axes, ("ttft_s", "tpot_s"), ("P99 TTFT", "P99 TPOT")):
        for i, (arm, result) in enumerate(results.items()):
            base = results["off"]["summary"]
            ratios = [(result["summary"][b][metric]["p99"] or 0) / (base[b][metric]["p99"] or 1) for b in buckets]
            ax.bar([x + (i - (len(results) - 1) / 2) * width for x in range(len(buckets))], ratios, width, label=arm)
        ax.axhline(1.05, color="red", linestyle="--", linewidth=1, label="off + 5%")
        ax.set_xticks(range(len(buckets)), buckets)
        ax.set_ylabel("P99 / P99 without speculation")
        ax.set_title(f"{title} per bucket ({args.model}, {qps:.2f} req/s)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _cell(s: dict, base: dict, metric: str) -> str:
    p99, ref = s[metric]["p99"], base[metric]["p99"]
    return "-" if p99 is None else f"{p99 * 1000:.0f} ({p99 / ref:.2f})" if ref else f"{p99 * 1000:.0f}"


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _line(arm: str, result: dict) -> str:
    s = result["summary"][ALL]
    return (f"{arm:>8}: TTFT P99 {_ms(s['ttft_s']['p99'])} ms, TPOT P99 {_ms(s['tpot_s']['p99'])} ms, "
            f"mean TPOT {_ms(s['tpot_s']['mean'])} ms, errors {s['errors']}, {result['wall_s']:.0f} s")


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default' (Gemma 3 270M), 'tiny', or a directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--qps", type=float, help="offered load; default: --load x measured capacity")
    p.add_argument("--load", type=float, default=0.85, help="fraction of the no-speculation capacity")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--depth", type=int, default=5, help="fixed arm's draft depth (adaptive: its start)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="split the measured requests into this many parts, the arms taking turns per part")
    p.add_argument("--round-seconds", type=float,
                   help="rounds of about this many seconds of arrivals (instead of --rounds)")
    p.add_argument("--minutes", type=float, help="start no round that would end the measured rounds past this")
    p.add_argument("--arms", nargs="*", choices=list(ARMS),
                   help="the arms to run (default: off fixed adaptive; off_again measures the noise floor)")
    p.add_argument("--tag", default="", help="suffix of the output files (docs/p99_incident<tag>.*)")
    p.add_argument("--from-json", type=Path, help="measure nothing: write the report again from a run's JSON")
    return p.parse_args()


def rerender(path: Path) -> None:
    """The markdown report of a saved run, with this version's tables (same numbers)."""
    saved = json.loads(path.read_text())
    args = argparse.Namespace(**saved["args"])
    results = {arm: {**a, "requests": [dict(zip(a["records"]["fields"], row)) for row in a["records"]["rows"]]}
               for arm, a in saved["arms"].items()}
    path.with_suffix(".md").write_text(markdown(results, saved["qps"], args, saved.get("void", "")))
    print(f"wrote {path.with_suffix('.md')}")


if __name__ == "__main__":
    asyncio.run(main())
