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
machine is shared and noisy.

vLLM's side (when benchmarks/anchors/setup_vllm.sh has set up its venv; `--skip vllm` leaves
it out), after specmesh's, its OpenAI server started per mode in turn (benchmarks/anchors/
compare.py's start_vllm), the same prompts, schemas, sampling and seeds on /v1/completions
with `structured_outputs: {"json": schema}` (vLLM 0.32's request field; the server's backend
set to xgrammar), streamed:
- `vLLM constrained`: structured outputs, no speculation;
- `vLLM constrained+ngram`: the same with its n-gram speculation at the same depth (a mode
  vLLM refuses, at start or per request, is reported with vLLM's own error, not measured).
Its tau is (accepted + drafts) / drafts from its /metrics counters, per verify pass as specmesh's.
The foreign CPU column is the median share of other processes while the mode ran (vLLM's
process tree counts as under test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import replace
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
from services.target.engine import engine as engine_module
from services.target.engine.engine import Engine
from services.target.server.app import build_target_server
from services.target.speculation import speculator as speculator_module
from specmesh.client import NO_RETRIES, AsyncClient
from specmesh.proto.v1 import common_pb2
from tests.mesh import AUTH_A, TOKEN_A, collect, request, start_draft  # noqa: E402
from benchmarks.anchors.compare import PAUSE_S, VLLM, VLLM_PORT, start_vllm, stop, wait_http  # noqa: E402

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
# The same two constrained modes with every row through the whole output layer (the engine's
# grammar_vocab_subsets off): what logits over the allowed tokens only saves.
WHOLE_ROWS = {"constrained, whole rows": "constrained", "constrained+grammar, whole rows": "constrained+grammar"}
SPECULATION_DEPTH = 8  # specmesh's draft depth, and vLLM's n-gram num_speculative_tokens
VLLM_MODES = {"vLLM constrained": 0, "vLLM constrained+ngram": SPECULATION_DEPTH}  # mode -> n-gram depth
ALL_MODES = (*MODES, *WHOLE_ROWS, *VLLM_MODES)


class MaskTimer:
    """Wraps the engine's mask hooks to sum the time they take per engine step."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        for module, name in ((plain_sampling_module, "masked_sample_rows"), (speculator_module, "masked_verify_rows")):
            setattr(module, name, self._timed(getattr(module, name)))
        # The masks are built before the forward (vocab subsets), then reused by the hooks above.
        fn = engine_module.step_vocab_subsets

        def timed_subsets(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - start
        engine_module.step_vocab_subsets = timed_subsets

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


def note(s: dict, tokens: int, first_s: float, elapsed: float, cut: bool, valid: bool,
         accepted: int = 0, passes: int = 0) -> None:
    """Adds one request to its (mode, sampling) row."""
    s["tokens"] += tokens
    s["seconds"] += elapsed
    s["decode_tokens"] += max(tokens - 1, 0)  # after the first token: the
    s["decode_seconds"] += elapsed - first_s  # prompt's prefill left out
    s["requests"] += 1
    s["cut"] += cut
    s["valid"] += valid
    s["accepted"] += accepted
    s["passes"] += passes


async def run(model_dir: Path, tokens: int, repeats: int, spans: dict) -> dict:
    """specmesh's modes; `spans` gets each mode's (monotonic start, end)."""
    draft = await start_draft(None)
    engine = Engine.load(EngineConfig(model_dir=model_dir, dtype="bfloat16", num_blocks=1024,
                                      draft_address=draft.address))
    target = build_target_server(ServerConfig(port=0), engine, "default")
    await target.start()
    timer = MaskTimer()
    stats = defaultdict(lambda: defaultdict(float))
    for mode in (*MODES, *WHOLE_ROWS):
        engine.config = replace(engine.config, grammar_vocab_subsets=mode not in WHOLE_ROWS)
        method = "prompt_lookup" if WHOLE_ROWS.get(mode, mode) == "constrained+grammar" else "off"
        router = build_router_server(ServerConfig(port=0), RouterConfig(
            target_address=target.address, tokens={TOKEN_A: "bench"}, speculation_method=method,
            speculation_depth=SPECULATION_DEPTH))
        await router.start()
        async with AsyncClient(router.address, retry=NO_RETRIES) as client:
            await collect(client, request("warm up", 4))
            for name, schema in SCHEMAS.items():  # grammars compiled, kernels built, before measuring
                for temperature in (0.0, 0.8):
                    extra = {} if mode == "free" else {"constraint": common_pb2.Constraint(json_schema=json.dumps(schema))}
                    await collect(client, request(PROMPTS[name], 8, temperature=temperature, **extra))
            start = time.monotonic()
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
                        # A constrained output cut by max_tokens ends `length` (an unfinished
                        # document, by design); validity is over the outputs that finished.
                        cut = last.finish_reason == common_pb2.FINISH_REASON_LENGTH
                        note(s, len(ids), first_s, elapsed, cut, mode == "free" or (not cut and _valid(text, schema)),
                             last.usage.accepted_tokens, last.usage.verify_passes)
                        s["mask_s"] += timer.seconds - mask_before[0]
                        s["mask_calls"] += timer.calls - mask_before[1]
            spans[mode] = (start, time.monotonic())
        await router.stop(grace=1)
    await target.stop(grace=1)
    await draft.stop(grace=1)
    return stats


def run_vllm(venv: Path, model_dir: Path, tokens: int, repeats: int, servers: list[subprocess.Popen],
             spans: dict) -> tuple[dict, dict[str, str]]:
    """vLLM's modes, one server per mode in turn (the one up is in `servers` while it runs, for
    the foreign-CPU monitor); returns (stats, mode -> vLLM's error where it refused the mode)."""
    stats, refused = defaultdict(lambda: defaultdict(float)), {}
    log_dir = Path(__file__).resolve().parent / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for mode, depth in VLLM_MODES.items():
        log = log_dir / f"vllm-structured-{depth}.log"
        proc = start_vllm(venv, model_dir, depth, log_dir, ("--structured-outputs-config",
                                                              json.dumps({"backend": "xgrammar"})), log.name)
        servers.append(proc)
        try:
            client = VLLM(VLLM_PORT, "gemma")
            wait_http(f"http://127.0.0.1:{VLLM_PORT}/health", proc)
            client.complete({"prompt": "warm up", "max_tokens": 4, "temperature": 0})
            for name, schema in SCHEMAS.items():  # each schema's grammar compiled before measuring
                client.complete({"prompt": PROMPTS[name], "max_tokens": 8, "temperature": 0,
                                 "structured_outputs": {"json": schema}})
            start, counts, last = time.monotonic(), spec_counts(), None
            for name, schema in SCHEMAS.items():
                for temperature in (0.0, 0.8):
                    for r in range(repeats):
                        time.sleep(PAUSE_S)  # vLLM's worker busy-polls ~1 s after a request
                        counts = _add_spec_counts(last, counts)  # the previous request's, settled
                        n, first_s, elapsed, text, finish = client.complete({
                            "prompt": PROMPTS[name], "max_tokens": tokens, "temperature": temperature,
                            "seed": r, "structured_outputs": {"json": schema}})
                        cut = finish == "length"
                        last = stats[(mode, "greedy" if temperature == 0 else "T=0.8")]
                        note(last, n, first_s, elapsed, cut, not cut and _valid(text, schema))
            spans[mode] = (start, time.monotonic())
            time.sleep(PAUSE_S)
            _add_spec_counts(last, counts)
        except (RuntimeError, OSError) as e:  # exited at start, or refused / crashed on a request
            refused[mode] = vllm_error(e, log)
            for key in [k for k in stats if k[0] == mode]:
                del stats[key]  # a mode that failed part-way is not measured
        finally:
            stop([proc])
            servers.remove(proc)
            time.sleep(3)  # its port and memory freed before the next one starts
    return stats, refused


def vllm_error(e: Exception, log: Path) -> str:
    """vLLM's own words on why a mode failed: an HTTP error's body, else its log's last error line."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}: {e.read().decode(errors='replace')[:400]}"
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    errors = [x for x in lines if "Error" in x or "error" in x]
    return f"{type(e).__name__}: {e}; log: {(errors or lines or ['(empty)'])[-1][:400]}"


def _add_spec_counts(row: dict | None, before: tuple[float, float]) -> tuple[float, float]:
    """Adds vLLM's drafts and accepted tokens since `before` to `row` (the request just run);
    returns the counts now. Read a pause after the request: its last step's counts may come late."""
    now = spec_counts()
    if row is not None:
        row["passes"] += now[0] - before[0]
        row["accepted"] += now[1] - before[1]
    return now


def spec_counts() -> tuple[float, float]:
    """vLLM's (speculation drafts, accepted draft tokens) so far, from its Prometheus /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{VLLM_PORT}/metrics", timeout=10).read().decode()
    totals = {"vllm:spec_decode_num_drafts_total": 0.0, "vllm:spec_decode_num_accepted_tokens_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["vllm:spec_decode_num_drafts_total"], totals["vllm:spec_decode_num_accepted_tokens_total"]


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


def report(stats: dict, foreign: dict[str, float | None], refused: dict[str, str]) -> None:
    """tok/s: output tokens over the whole request (prefill included); decode tok/s: tokens
    after the first over the time after the first (what a constraint or speculation changes:
    the prompt's prefill is the same in every mode, and outputs of different lengths would
    otherwise share it out differently)."""
    print(f"{'mode':<24}{'sampling':<9}{'tok/s':>8}{'decode tok/s':>14}{'ms/tok':>8}{'valid':>8}{'cut':>5}"
          f"{'tau':>6}{'mask ms/step':>14}{'foreign':>9}")
    for (mode, sampling), s in sorted(stats.items(), key=lambda kv: (ALL_MODES.index(kv[0][0]), kv[0][1])):
        tau = (s["accepted"] + s["passes"]) / s["passes"] if s["passes"] else 1.0
        mask = "-" if mode in VLLM_MODES else f"{1000 * s['mask_s'] / s['mask_calls'] if s['mask_calls'] else 0.0:.3f}"
        valid = "-" if mode == "free" else f"{s['valid'] / max(s['requests'] - s['cut'], 1):.0%}"
        share = "-" if foreign.get(mode) is None else f"{foreign[mode]:.1%}"
        print(f"{mode:<24}{sampling:<9}{s['tokens'] / s['seconds']:>8.1f}"
              f"{s['decode_tokens'] / s['decode_seconds']:>14.1f}{1000 * s['seconds'] / s['tokens']:>8.1f}"
              f"{valid:>8}{int(s['cut']):>5}{tau:>6.2f}{mask:>14}{share:>9}")
    for mode, error in refused.items():
        print(f"{mode:<24}not supported by vLLM's CPU build here: {error}")
    for sampling in ("greedy", "T=0.8"):
        free, con, spec = (stats[(m, sampling)] for m in MODES)
        whole = lambda s: s["seconds"] / s["tokens"]  # noqa: E731
        decode = lambda s: s["decode_seconds"] / s["decode_tokens"]  # noqa: E731
        print(f"{sampling}: constrained / free per decoded token {decode(con) / decode(free):.2f}x "
              f"(whole request {whole(con) / whole(free):.2f}x); grammar speculation / constrained "
              f"decode tokens/s {decode(con) / decode(spec):.2f}x (whole request {whole(con) / whole(spec):.2f}x)")
        for mode, base in WHOLE_ROWS.items():
            if (mode, sampling) in stats:
                rows = stats[(mode, sampling)]
                print(f"{sampling}: {base} with allowed-token logits / {mode}: decode tokens/s "
                      f"{decode(rows) / decode(stats[(base, sampling)]):.2f}x")
        for mode in VLLM_MODES:
            if (mode, sampling) in stats:
                other = stats[(mode, sampling)]
                print(f"{sampling}: specmesh constrained+grammar / {mode} tokens/s {whole(other) / whole(spec):.2f}x "
                      f"(decode tokens/s {decode(other) / decode(spec):.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip", nargs="*", default=[], choices=["vllm"])
    parser.add_argument("--vllm-venv", default=os.environ.get("SPECMESH_VLLM_VENV", "~/.cache/specmesh/vllm-venv"))
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    venv = Path(args.vllm_venv).expanduser()
    with_vllm = "vllm" not in args.skip and (venv / "bin" / "python").exists()
    if "vllm" not in args.skip and not with_vllm:
        print(f"vLLM: left out, no venv at {venv}; run `bash benchmarks/anchors/setup_vllm.sh` once "
              "(or --skip vllm to say so)")
    servers: list[subprocess.Popen] = []  # the vLLM server up now, under test with this process
    spans: dict[str, tuple[float, float]] = {}
    refused: dict[str, str] = {}
    # CPU used by anything outside this process and the vLLM server's tree meanwhile.
    with ForeignCpu(lambda: [os.getpid(), *(p.pid for p in servers)]) as cpu:
        stats = asyncio.run(run(model_dir, args.tokens, args.repeats, spans))
        if with_vllm:
            vllm_stats, refused = run_vllm(venv, model_dir, args.tokens, args.repeats, servers, spans)
            stats.update(vllm_stats)
    foreign = cpu.share()
    print(f"model={args.model} bf16, max_tokens={args.tokens}, repeats={args.repeats}; foreign CPU "
          f"median {100 * (foreign['median'] or 0):.1f}%, max {100 * (foreign['max'] or 0):.1f}%"
          + ("  VOID: another process used the machine" if foreign["void"] else ""))
    report(stats, {mode: cpu.share(*span)["median"] for mode, span in spans.items()}, refused)


if __name__ == "__main__":
    main()
