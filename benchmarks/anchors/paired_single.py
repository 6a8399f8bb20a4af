"""Single-stream decode, specmesh against llama.cpp in interleaved pairs: both servers up, one
request to each in turn.

    python -u benchmarks/anchors/paired_single.py                     # 40 pairs, llama.cpp Q4_K_M
    python -u benchmarks/anchors/paired_single.py --llamacpp BF16 --specmesh-weights bf16-avx512

compare.py measures each system in minutes of its own, and what a shared machine gives a system
drifts between those minutes: two quiet runs of compare.py twelve minutes apart (2026-12-08, the
AVX512-BF16 EPYC, foreign CPU 1% in every row) measured specmesh at 73.5 then 59.4 tok/s and
llama.cpp Q4_K_M at 69.7 then 74.2. Here a pair is two requests seconds apart (compare.py's
prompts in turn, the order alternating per pair), so drift reaches both alike. The report gives
each system's median, the median of the per-pair ratios with a 90% bootstrap interval, and leaves
out every pair where either request ran beside more than 5% foreign CPU (it says how many).
Needs `bash benchmarks/anchors/setup_llamacpp.sh`. Writes benchmarks/results/paired-single-*.md
and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.anchors.compare import (LLAMACPP_GGUF, LLAMACPP_PORT, PAUSE_S, PORTS, LlamaCpp, Specmesh,  # noqa: E402
                                        llamacpp_context, llamacpp_files, llamacpp_missing, make_prompts,
                                        served_weights, start_llamacpp_ready, start_specmesh, stop, wait_grpc)
from services.bench.foreign_cpu import VOID_SHARE, ForeignCpu  # noqa: E402

SPECMESH = "specmesh"


def decode_rate(tokens: int, ttft: float, total: float) -> float:
    """Tokens a second after the first token (compare.py's single-stream measure)."""
    return (tokens - 1) / max(total - ttft, 1e-9)


def bootstrap_median(values: list[float], level: float = 0.90, resamples: int = 2000, seed: int = 0,
                     ) -> tuple[float, float]:
    """The `level` interval of the median of `values`, by resampling them with replacement."""
    rng = random.Random(seed)
    medians = sorted(statistics.median([rng.choice(values) for _ in values]) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1))]


def summarize_pairs(pairs: list[dict], other: str) -> dict:
    """pairs: {SPECMESH: tok/s, other: tok/s, "foreign": {system: share}} each -> each system's
    median over the clean pairs, the median per-pair ratio specmesh / other with its 90% interval,
    and how many pairs were void (either request beside more than VOID_SHARE foreign CPU)."""
    clean = [p for p in pairs if max(p["foreign"].values()) <= VOID_SHARE]
    out = {"pairs": len(pairs), "void": len(pairs) - len(clean), "other": other}
    if not clean:
        return out | {"ratio": None}
    ratios = [p[SPECMESH] / p[other] for p in clean]
    low, high = bootstrap_median(ratios)
    return out | {SPECMESH: statistics.median([p[SPECMESH] for p in clean]),
                  other: statistics.median([p[other] for p in clean]),
                  "ratio": statistics.median(ratios), "ratio_90": [low, high],
                  "foreign_median": statistics.median([s for p in clean for s in p["foreign"].values()])}


def report(summary: dict, header: str) -> str:
    other = summary["other"]
    if summary["ratio"] is None:
        return f"{header}\n\nEvery one of the {summary['pairs']} pairs was void (foreign CPU above {VOID_SHARE:.0%})."
    low, high = summary["ratio_90"]
    return (f"{header}\n\n"
            f"| | {SPECMESH} | {other} | {SPECMESH} / {other}, median of the pairs [90% interval] |\n"
            f"|---|---:|---:|---:|\n"
            f"| single-stream decode, tok/s (median) | {summary[SPECMESH]:.1f} | {summary[other]:.1f} | "
            f"{summary['ratio']:.2f}x [{low:.2f}, {high:.2f}] |\n\n"
            f"{summary['pairs'] - summary['void']} clean pairs of {summary['pairs']} ({summary['void']} void: "
            f"foreign CPU above {VOID_SHARE:.0%} beside either request); foreign CPU median "
            f"{summary['foreign_median']:.1%} over the clean ones.\n")


async def run(args) -> tuple[list[dict], str, str | None]:
    from transformers import AutoTokenizer

    from services.common.models.loading import resolve_model_dir
    directory = Path(args.llamacpp_dir).expanduser()
    if llamacpp_missing(directory):
        raise SystemExit(f"llama.cpp is not set up ({llamacpp_missing(directory)}): "
                         "run `bash benchmarks/anchors/setup_llamacpp.sh` first")
    model_dir = resolve_model_dir("default", Path.home() / ".cache" / "specmesh" / "models")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tokenizer)[:args.prompts]
    log_dir = ROOT / "benchmarks" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    other = f"llama.cpp {args.llamacpp}"
    server, ggufs = llamacpp_files(directory)
    context = llamacpp_context(max(len(tokenizer(p).input_ids) for p in prompts), args.tokens)
    procs = start_specmesh("default", log_dir, args.specmesh_weights)
    llama_proc = None
    cpu = ForeignCpu(lambda: [os.getpid(), *(p.pid for p in procs), *([llama_proc.pid] if llama_proc else [])],
                     interval_s=0.5)
    pairs: list[dict] = []
    try:
        await wait_grpc(f"127.0.0.1:{PORTS['router-off']}", procs)
        llama_proc = start_llamacpp_ready(other, server, ggufs[other], context, log_dir / "paired-llamacpp.log")
        clients = {SPECMESH: Specmesh(PORTS["router-off"]), other: LlamaCpp(LLAMACPP_PORT, "gemma")}
        for client in clients.values():  # first-call setup is not serving
            await client.generate(prompts[0], 8)
        with cpu:
            for i in tqdm(range(args.pairs), desc="pairs"):
                order = [SPECMESH, other] if i % 2 == 0 else [other, SPECMESH]
                pair: dict = {"prompt": i % len(prompts), "foreign": {}}
                for system in order:
                    time.sleep(PAUSE_S)
                    start = time.monotonic()
                    n, ttft, total = await clients[system].generate(prompts[i % len(prompts)], args.tokens)
                    share = cpu.share(start - cpu.interval_s, time.monotonic() + cpu.interval_s)["median"]
                    pair[system] = decode_rate(n, ttft, total)
                    pair["foreign"][system] = share or 0.0
                pairs.append(pair)
    finally:
        stop(procs + ([llama_proc] if llama_proc else []))
    return pairs, other, served_weights(log_dir / "target.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=5, help="how many of compare.py's nine prompts, in turn")
    parser.add_argument("--llamacpp", default="Q4_K_M", choices=[k.split()[-1] for k in LLAMACPP_GGUF])
    parser.add_argument("--specmesh-weights", default="auto",
                        choices=["auto", "bf16-avx512", "gguf", "gguf-bf16"])
    parser.add_argument("--llamacpp-dir", default=os.environ.get("SPECMESH_LLAMACPP_DIR", "~/.cache/specmesh/llamacpp"))
    args = parser.parse_args()
    pairs, other, served = asyncio.run(run(args))
    summary = summarize_pairs(pairs, other)
    load = os.getloadavg()
    header = (f"Single-stream pairs: specmesh (weights {args.specmesh_weights}"
              + (f" -> {served}" if served and served != args.specmesh_weights else "")
              + f", through the router, speculation off) against {other} (llama-server -t 2), greedy, "
              f"{args.tokens} tokens, compare.py's first {args.prompts} prompts in turn, {args.pairs} pairs "
              f"(the order alternating); load average at the end {load[0]:.1f} on {os.cpu_count()} cores")
    md = report(summary, header)
    out = ROOT / "benchmarks" / "results"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"paired-single-{stamp}.json").write_text(json.dumps({"args": vars(args), "pairs": pairs,
                                                                  "summary": summary}, indent=1))
    (out / f"paired-single-{stamp}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
