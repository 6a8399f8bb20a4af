"""Speculative decoding through the whole mesh, per bucket, side by side in one run.

    python benchmarks/speculation.py --tokens 96

Starts router + target + draft gRPC servers on loopback (default model, bf16) and, for
each bucket (code completion, copy-heavy code edit, summarization of a given document,
open-ended chat, creative sampling at temperature 1), measures end-to-end tokens/s
through the router with speculation off and with each proposer, the acceptance length
and acceptance rate, and Hugging Face `generate` with and without
`prompt_lookup_num_tokens=10` on the same prompts. Ratios are what to read: these
machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.mesh helpers

from services.settings import read_settings
from services.common.models.loading import resolve_model_dir
from specmesh.client import NO_RETRIES, AsyncClient
from services.common.server import ServerConfig
from services.router.app import build_router_server
from services.router.config import RouterConfig
from services.target.server.app import build_target_server
from services.target.config import EngineConfig
from services.target.engine.engine import Engine
from tests.mesh import AUTH_A, TOKEN_A, collect, request, start_draft  # noqa: E402

_CODE = '''def parse_config(path):
    """Read a key=value config file into a dict."""
    result = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            result[key.strip()] = value.strip()
    return result
'''
_DOC = ("The city council met on Tuesday to discuss the new public library. The library will "
        "be built on the site of the old train station, which has been empty for ten years. "
        "Construction will start in March and is expected to take two years. The council "
        "approved a budget of twelve million dollars, of which four million will come from a "
        "state grant. Residents at the meeting asked for longer opening hours, a children's "
        "reading room, and free internet access. The mayor said the library would open seven "
        "days a week and that the reading room was already part of the plan. Some residents "
        "worried about parking; the council promised a study of traffic around the site.")

BUCKETS = {
    "code completion": (f"{_CODE}\n\ndef write_config(path, values):\n    \"\"\"Write a dict as a key=value config file.\"\"\"\n", 0.0),
    "code edit (copy-heavy)": (f"Rewrite this function, renaming `result` to `config` and keeping everything else the same.\n\n{_CODE}\nRewritten:\n", 0.0),
    "summarization": (f"Document:\n{_DOC}\n\nSummarize the document above in three sentences, using its own words:\n", 0.0),
    "open-ended chat": ("What are some good ways to spend a rainy weekend at home?", 0.0),
    "creative (temperature 1)": ("Write a short poem about the sea at night.", 1.0),
}
DEFAULT_PLANS = ["off", "prompt_lookup:5", "suffix:5:12"]


def parse_plan(text: str) -> tuple[str, int, int, str]:
    """"[adaptive/]method[:depth[:nodes]]" -> (method, depth, nodes, policy)."""
    policy, _, spec = text.rpartition("/")
    parts = spec.split(":")
    return (parts[0], int(parts[1]) if len(parts) > 1 else 0, int(parts[2]) if len(parts) > 2 else 0,
            policy or "fixed")


def plan_label(method: str, depth: int, nodes: int, policy: str = "fixed") -> str:
    if method == "off":
        return method
    label = f"{method} d{depth}" + (f" n{nodes}" if nodes else "")
    return f"adaptive {label}" if policy == "adaptive" else label


@dataclass
class Row:
    bucket: str
    method: str
    tokens: int
    seconds: float
    proposed: int = 0
    accepted: int = 0
    tau: float = 0.0


async def run_mesh(model_dir: Path, tokens: int, repeats: int, plans: list[tuple]) -> list[Row]:
    draft = await start_draft(None)
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype="bfloat16", num_blocks=1024,
                                      draft_address=draft.address))
    target = build_target_server(ServerConfig(port=0), engine, "default")
    await target.start()
    rows = []
    for method, depth, nodes, policy in tqdm(plans, desc="plans"):
        label = plan_label(method, depth, nodes, policy)
        router = build_router_server(ServerConfig(port=0), RouterConfig(
            target_address=target.address, tokens={TOKEN_A: "bench"}, speculation_method=method,
            speculation_depth=max(depth, 1), speculation_nodes=nodes, speculation_policy=policy))
        await router.start()
        async with AsyncClient(router.address, retry=NO_RETRIES) as client:
            for _ in range(50):
                if engine.speculator.client.connected:
                    break
                await asyncio.sleep(0.05)
            await collect(client, request("warm up", 4))
            for bucket, (prompt, temperature) in tqdm(BUCKETS.items(), desc=label, leave=False):
                for r in range(repeats):
                    extra = {"temperature": temperature, "seed": r, "has_seed": True} if temperature else {}
                    start = time.perf_counter()
                    ids, _, last = await collect(client, request(prompt, tokens, **extra), AUTH_A)
                    elapsed = time.perf_counter() - start
                    u = last.usage
                    rows.append(Row(bucket, label, len(ids), elapsed, u.proposed_tokens,
                                    u.accepted_tokens, u.acceptance_length))
        await router.stop(grace=1)
    # Hugging Face on the engine's thread (one OpenMP team), while the mesh is idle.
    rows += engine.run_on_engine_thread(run_hf, model_dir, tokens, repeats)
    await target.stop(grace=1)
    await draft.stop(grace=1)
    return rows


def run_hf(model_dir: Path, tokens: int, repeats: int) -> list[Row]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    rows = []
    for label, extra in tqdm([("HF generate", {}), ("HF prompt lookup 10", {"prompt_lookup_num_tokens": 10})],
                             desc="Hugging Face"):
        for bucket, (prompt, temperature) in BUCKETS.items():
            for r in range(repeats):
                ids = tokenizer(prompt, return_tensors="pt")
                sampling = {"do_sample": True, "temperature": temperature} if temperature else {"do_sample": False}
                torch.manual_seed(r)
                start = time.perf_counter()
                out = model.generate(**ids, max_new_tokens=tokens, **sampling, **extra)
                rows.append(Row(bucket, label, out.shape[1] - ids.input_ids.shape[1],
                                time.perf_counter() - start))
    return rows


def report(rows: list[Row], plans: list[tuple]) -> None:
    by = {}
    for row in rows:
        agg = by.setdefault((row.bucket, row.method), [0, 0.0, 0, 0, 0.0, 0])
        agg[0] += row.tokens
        agg[1] += row.seconds
        agg[2] += row.proposed
        agg[3] += row.accepted
        agg[4] += row.tau
        agg[5] += 1
    methods = [plan_label(*p) for p in plans] + ["HF generate", "HF prompt lookup 10"]
    print(f"\n{'bucket':<26} {'method':<28} {'tok/s':>7} {'vs off':>7} {'vs HF PL':>8} {'tau':>5} {'accept%':>8}")
    for bucket in BUCKETS:
        off = by[(bucket, "off")][0] / by[(bucket, "off")][1]
        hf_pl = by[(bucket, "HF prompt lookup 10")][0] / by[(bucket, "HF prompt lookup 10")][1]
        for method in methods:
            tok, sec, prop, acc, tau, n = by[(bucket, method)]
            rate = tok / sec
            accept = f"{100 * acc / prop:.0f}%" if prop else "-"
            tau_s = f"{tau / n:.2f}" if prop else "-"
            print(f"{bucket:<26} {method:<28} {rate:>7.1f} {rate / off:>6.2f}x {rate / hf_pl:>7.2f}x "
                  f"{tau_s:>5} {accept:>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--plans", nargs="+", default=DEFAULT_PLANS,
                        help="speculation plans as [adaptive/]method[:depth[:nodes]]")
    parser.add_argument("--plot", type=Path, help="also draw tokens/s per bucket and method to this PNG")
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    plans = [parse_plan(p) for p in args.plans]
    if plans[0][0] != "off":
        plans.insert(0, ("off", 0, 0, "fixed"))
    rows = asyncio.run(run_mesh(model_dir, args.tokens, args.repeats, plans))
    print(f"model={args.model} bf16, max_tokens={args.tokens}, repeats={args.repeats}, "
          f"threads={torch.get_num_threads()}")
    report(rows, plans)
    if args.plot:
        plot(rows, [plan_label(*p) for p in plans] + ["HF generate", "HF prompt lookup 10"], args.plot)
        print(f"plot written to {args.plot}")


def plot(rows: list[Row], methods: list[str], path: Path) -> None:
    """Grouped bars: tokens/s per bucket, one bar per method (needs matplotlib: `.[bench]`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rate = {}
    for row in rows:
        tok, sec = rate.get((row.bucket, row.method), (0, 0.0))
        rate[(row.bucket, row.method)] = (tok + row.tokens, sec + row.seconds)
    buckets = list(BUCKETS)
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(13, 5))
    for i, method in enumerate(methods):
        values = [rate[(b, method)][0] / rate[(b, method)][1] for b in buckets]
        ax.bar([x + i * width for x in range(len(buckets))], values, width, label=method)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(buckets))], buckets, rotation=10)
    ax.set_ylabel("tokens/s (end to end through the mesh)")
    ax.set_title("Speculative decoding per bucket (default model, bf16, 2 CPU cores)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
