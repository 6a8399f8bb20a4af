"""Structured outputs through the mesh, side by side in one run (issue 24's measurements).

    python benchmarks/structured_outputs.py --tokens 128 --repeats 1

Starts draft (prompt lookup) + target (default model, bf16) + one router per mode on
loopback and runs a JSON-schema and tool-call workload (several schemas, greedy and
T=0.8), one request at a time:
- `free`: the same prompts without a constraint, speculation off (cost per token baseline);
- `constrained`: with the constraint, speculation off;
- `constrained+grammar`: with the constraint, the router's `structured` bucket plan
  (grammar drafts where the grammar forces the text, prompt lookup for the free parts).
Reports tokens/s, seconds per token, the validity rate (jsonschema) of the outputs that
finished and how many max_tokens cut (`cut`: those end `length`, unfinished), acceptance length, and
the time spent building and applying masks per engine step. Ratios are what to read: the
machine is shared and noisy. (vLLM's side, benchmarks/anchors/, is not run here.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.mesh helpers

from services.bench.foreign_cpu import ForeignCpu
from services.settings import read_settings
from services.common.models.loading import resolve_model_dir
from services.common.server import ServerConfig
from services.router.app import build_router_server
from services.router.config import RouterConfig
from services.target.config import EngineConfig
from services.target.engine import plain_sampling as plain_sampling_module
from services.target.engine.engine import Engine
from services.target.server.app import build_target_server
from services.target.speculation import speculator as speculator_module
from specmesh.client import NO_RETRIES, AsyncClient
from specmesh.proto.v1 import common_pb2
from tests.mesh import AUTH_A, TOKEN_A, collect, request, start_draft  # noqa: E402

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False,
               "required": ["full_name", "age", "email_address", "is_premium_member"],
               "properties": {"full_name": {"type": "string", "maxLength": 40},
                              "age": {"type": "integer", "minimum": 0, "maximum": 130},
                              "email_address": {"type": "string", "maxLength": 60},
                              "is_premium_member": {"type": "boolean"}}},
    "order": {"type": "object", "additionalProperties": False,
              "required": ["customer_account_identifier", "requested_delivery_window", "items"],
              "properties": {"customer_account_identifier": {"type": "string", "maxLength": 16},
                             "requested_delivery_window": {"enum": ["morning", "afternoon", "evening"]},
                             "items": {"type": "array", "maxItems": 3, "items": {
                                 "type": "object", "additionalProperties": False,
                                 "required": ["product_sku", "quantity"],
                                 "properties": {"product_sku": {"type": "string", "maxLength": 12},
                                                "quantity": {"type": "integer", "minimum": 1,
                                                             "maximum": 99}}}}}},
    "tool_call": {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"enum": ["get_current_weather", "search_flights"]},
                                 "arguments": {"type": "object", "additionalProperties": False,
                                               "required": ["location", "temperature_unit"],
                                               "properties": {
                                                   "location": {"type": "string", "maxLength": 40},
                                                   "temperature_unit": {"enum": ["celsius", "fahrenheit"]}}}}},
}
PROMPTS = {
    "person": "Extract the person as JSON. Text: Maria Gonzalez is 34 years old, her email is "
              "maria.gonzalez@example.com and she is a premium member.\nJSON: ",
    "order": "Turn this order into JSON. Customer ACC-99812 wants delivery in the evening: two of "
             "SKU-1182 and one of SKU-7730.\nJSON: ",
    "tool_call": "You can call get_current_weather(location, temperature_unit) or search_flights. "
                 "User: what is the weather in Lisbon, Portugal, in celsius?\nTool call JSON: ",
}
MODES = ("free", "constrained", "constrained+grammar")


class MaskTimer:
    """Wraps the engine's mask hooks to sum the time they take per engine step."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        for module, name in ((plain_sampling_module, "masked_sample_rows"), (speculator_module, "masked_verify_rows")):
            setattr(module, name, self._timed(getattr(module, name)))

    def _timed(self, fn):
        def timed(seq, *args):
            if seq.grammar is None:
                return fn(seq, *args)
            start = time.perf_counter()
            try:
                return fn(seq, *args)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return timed


async def run(model_dir: Path, tokens: int, repeats: int) -> dict:
    draft = await start_draft(None)
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype="bfloat16", num_blocks=1024,
                                      draft_address=draft.address))
    target = build_target_server(ServerConfig(port=0), engine, "default")
    await target.start()
    timer = MaskTimer()
    stats = defaultdict(lambda: defaultdict(float))
    for mode in MODES:
        method = "prompt_lookup" if mode == "constrained+grammar" else "off"
        router = build_router_server(ServerConfig(port=0), RouterConfig(
            target_address=target.address, tokens={TOKEN_A: "bench"}, speculation_method=method,
            speculation_depth=8))
        await router.start()
        async with AsyncClient(router.address, retry=NO_RETRIES) as client:
            await collect(client, request("warm up", 4))
            for name, schema in SCHEMAS.items():
                constraint = common_pb2.Constraint(json_schema=json.dumps(schema))
                for temperature in (0.0, 0.8):
                    for r in range(repeats):
                        extra = {} if mode == "free" else {"constraint": constraint}
                        req = request(PROMPTS[name], tokens, temperature=temperature, seed=r,
                                      has_seed=True, **extra)
                        mask_before = (timer.seconds, timer.calls)
                        ids, text, last, first_s, elapsed = await timed_collect(client, req)
                        s = stats[(mode, "greedy" if temperature == 0 else "T=0.8")]
                        s["tokens"] += len(ids)
                        s["seconds"] += elapsed
                        s["decode_tokens"] += max(len(ids) - 1, 0)  # after the first token: the
                        s["decode_seconds"] += elapsed - first_s  # prompt's prefill left out
                        s["requests"] += 1
                        # A constrained output cut by max_tokens ends `length` (an unfinished
                        # document, by design); validity is over the outputs that finished.
                        cut = last.finish_reason == common_pb2.FINISH_REASON_LENGTH
                        s["cut"] += cut
                        s["valid"] += mode == "free" or (not cut and _valid(text, schema))
                        s["accepted"] += last.usage.accepted_tokens
                        s["passes"] += last.usage.verify_passes
                        s["mask_s"] += timer.seconds - mask_before[0]
                        s["mask_calls"] += timer.calls - mask_before[1]
        await router.stop(grace=1)
    await target.stop(grace=1)
    await draft.stop(grace=1)
    return stats


async def timed_collect(client, req) -> tuple[list[int], str, common_pb2.GenerateChunk, float, float]:
    """One Generate call: (token ids, text, final chunk, seconds to the first token, seconds)."""
    ids, text, last, first = [], "", None, None
    start = time.perf_counter()
    async for response in client.stream(req, metadata=AUTH_A):
        if response.chunk.token_ids and first is None:
            first = time.perf_counter() - start
        ids.extend(response.chunk.token_ids)
        text += response.chunk.text
        last = response.chunk
    return ids, text, last, first or 0.0, time.perf_counter() - start


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def report(stats: dict) -> None:
    """tok/s: output tokens over the whole request (prefill included); decode tok/s: tokens
    after the first over the time after the first (what a constraint or speculation changes:
    the prompt's prefill is the same in every mode, and outputs of different lengths would
    otherwise share it out differently)."""
    print(f"{'mode':<22}{'sampling':<9}{'tok/s':>8}{'decode tok/s':>14}{'ms/tok':>8}{'valid':>8}{'cut':>5}"
          f"{'tau':>6}{'mask ms/step':>14}")
    for (mode, sampling), s in sorted(stats.items(), key=lambda kv: (MODES.index(kv[0][0]), kv[0][1])):
        tau = (s["accepted"] + s["passes"]) / s["passes"] if s["passes"] else 1.0
        mask = 1000 * s["mask_s"] / s["mask_calls"] if s["mask_calls"] else 0.0
        valid = "-" if mode == "free" else f"{s['valid'] / max(s['requests'] - s['cut'], 1):.0%}"
        print(f"{mode:<22}{sampling:<9}{s['tokens'] / s['seconds']:>8.1f}"
              f"{s['decode_tokens'] / s['decode_seconds']:>14.1f}{1000 * s['seconds'] / s['tokens']:>8.1f}"
              f"{valid:>8}{int(s['cut']):>5}{tau:>6.2f}{mask:>14.3f}")
    for sampling in ("greedy", "T=0.8"):
        free, con, spec = (stats[(m, sampling)] for m in MODES)
        whole = lambda s: s["seconds"] / s["tokens"]  # noqa: E731
        decode = lambda s: s["decode_seconds"] / s["decode_tokens"]  # noqa: E731
        print(f"{sampling}: constrained / free per decoded token {decode(con) / decode(free):.2f}x "
              f"(whole request {whole(con) / whole(free):.2f}x); grammar speculation / constrained "
              f"decode tokens/s {decode(con) / decode(spec):.2f}x (whole request {whole(con) / whole(spec):.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    with ForeignCpu() as cpu:  # CPU used by anything outside this process meanwhile
        stats = asyncio.run(run(model_dir, args.tokens, args.repeats))
    foreign = cpu.share()
    print(f"model={args.model} bf16, max_tokens={args.tokens}, repeats={args.repeats}; foreign CPU "
          f"median {100 * (foreign['median'] or 0):.1f}%, max {100 * (foreign['max'] or 0):.1f}%"
          + ("  VOID: another process used the machine" if foreign["void"] else ""))
    report(stats)


if __name__ == "__main__":
    main()
