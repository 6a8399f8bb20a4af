"""GPU check of the whole target: the engine and a mesh on CUDA, one table, at most ~5 minutes.

    python benchmarks/gpu_mesh.py               # on a CUDA machine: default model, fp32 and bf16
    python benchmarks/gpu_mesh.py --cpu-smoke   # a tiny model on the CPU, fp32 (checks this script)

Never in CI (a GPU machine is lent rarely; run it once there and keep its table). For each dtype
it starts a draft service, a target engine on the device behind its gRPC server and one router per
speculation method, all on loopback, and checks:
  * greedy output token for token against Hugging Face `generate` on the same device and dtype,
    speculation off and with every proposer (prompt lookup, suffix, draft model, dynamic tree);
  * a seeded sampled request twice (same tokens) and with speculation (a full-length answer);
  * FP8 KV (greedy agreement with `generate`, reported, not required: FP8 rounds the cache);
  * a JSON-schema constrained request (the output parses and validates);
then runs the kernel tests with compiled Triton kernels (benchmarks/gpu_kernels.py's step).
Without CUDA (and without --cpu-smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.server import ServerConfig  # noqa: E402
from services.router.app import build_router_server  # noqa: E402
from services.router.config import RouterConfig  # noqa: E402
from services.target.config import EngineConfig  # noqa: E402
from services.target.engine.engine import Engine  # noqa: E402
from services.target.server.app import build_target_server  # noqa: E402
from specmesh.client import NO_RETRIES, AsyncClient  # noqa: E402
from specmesh.proto.v1 import common_pb2  # noqa: E402
from tests.mesh import TOKEN_A, collect, request, start_draft  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Summarize: the meeting moved to Tuesday because the room was booked. The meeting moved to"]
METHODS = ["off", "prompt_lookup", "suffix", "draft_model", "dynamic_tree"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


def hf_greedy(model_dir: Path, device: str, dtype: torch.dtype, tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
        out.append(gen[0, ids.shape[1]:].tolist())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def agreement(ours: list[int], theirs: list[int]) -> int:
    """Tokens equal before the first difference."""
    n = 0
    for a, b in zip(ours, theirs):
        if a != b:
            break
        n += 1
    return n


async def check_dtype(model_dir: Path, device: str, dtype: str, tokens: int, rows: list) -> None:
    torch_dtype = getattr(torch, dtype)
    started = time.perf_counter()
    reference = hf_greedy(model_dir, device, torch_dtype, tokens)
    rows.append((dtype, "HF generate on the device", "ran", f"{len(PROMPTS)} prompts", time.perf_counter() - started))
    draft = await start_draft(model_dir)  # the target itself as its draft LM: every drafted token agrees
    for kv_dtype in ("auto", "fp8"):
        started = time.perf_counter()
        engine = Engine.load(EngineConfig(model_dir=model_dir, dtype=dtype, device=device, kv_dtype=kv_dtype,
                                          num_blocks=512, draft_address=draft.address))
        target = build_target_server(ServerConfig(port=0), engine, "gpu-check")
        await target.start()
        rows.append((dtype, f"engine loaded (kv {kv_dtype})", "ran", device, time.perf_counter() - started))
        methods = METHODS if kv_dtype == "auto" else ["off"]
        for method in methods:
            started = time.perf_counter()
            router = build_router_server(ServerConfig(port=0), RouterConfig(
                target_address=target.address, tokens={TOKEN_A: "gpu"}, speculation_method=method,
                speculation_depth=4, speculation_policy="fixed"))
            await router.start()
            try:
                async with AsyncClient(router.address, retry=NO_RETRIES) as client:
                    got = [(await collect(client, request(p, tokens, min_tokens=tokens)))[0] for p in PROMPTS]
                    same = [agreement(g, r) for g, r in zip(got, reference)]
                    exact = all(s == tokens for s in same)
                    name = f"greedy vs HF, {method}" + (" , FP8 KV" if kv_dtype == "fp8" else "")
                    verdict = ("PASS" if exact else "FAIL") if kv_dtype == "auto" else "info"
                    rows.append((dtype, name, verdict, f"agree {sum(same)}/{tokens * len(PROMPTS)}",
                                 time.perf_counter() - started))
                    if kv_dtype == "auto" and method in ("off", "draft_model"):
                        await sampled_checks(client, dtype, method, tokens, rows)
                    if kv_dtype == "auto" and method == "off":
                        await constrained_check(client, dtype, rows)
            except Exception as exc:  # a failure is a row of the table, not the end of the run
                rows.append((dtype, f"{method} (kv {kv_dtype})", "FAIL", f"{type(exc).__name__}: {exc}"[:90],
                             time.perf_counter() - started))
            finally:
                await router.stop(grace=1)
        await target.stop(grace=1)
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    await draft.stop(grace=1)


async def sampled_checks(client, dtype: str, method: str, tokens: int, rows: list) -> None:
    started = time.perf_counter()
    req = request(PROMPTS[0], tokens, temperature=0.8, top_p=0.95, seed=7, has_seed=True, min_tokens=tokens)
    first, _, last = await collect(client, req)
    second, _, _ = await collect(client, req)
    ok = first == second and len(first) == tokens
    rows.append((dtype, f"sampled, seed 7, {method}", "PASS" if ok else "FAIL",
                 f"{len(first)} tokens, repeat {'same' if first == second else 'differs'}, "
                 f"accepted {last.usage.accepted_tokens}", time.perf_counter() - started))


async def constrained_check(client, dtype: str, rows: list) -> None:
    import jsonschema
    started = time.perf_counter()
    req = request("A person as JSON:", 48, constraint=common_pb2.Constraint(json_schema=json.dumps(SCHEMA)))
    _, text, last = await collect(client, req)
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        verdict, detail = "PASS", text[:60]
    except (ValueError, jsonschema.ValidationError) as exc:
        cut = last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        verdict, detail = ("info" if cut else "FAIL"), f"{'cut by max_tokens' if cut else exc}: {text[:40]!r}"
    rows.append((dtype, "JSON schema constraint", verdict, detail, time.perf_counter() - started))


def print_table(rows: list) -> None:
    print("\n| dtype | check | result | detail | s |\n|---|---|---|---|---:|")
    for dtype, check, verdict, detail, seconds in rows:
        print(f"| {dtype} | {check} | {verdict} | {str(detail).replace('|', '/')} | {seconds:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, fp32: checks the script")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--no-kernel-tests", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("gpu_mesh: no CUDA device here; nothing to check (run this on a CUDA machine). Exiting 0.")
        return 0
    started = time.time()
    rows: list = []
    if args.cpu_smoke:
        from services.common.models.tiny import build_tiny_model
        model_dir, device, dtypes = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="gemma3", seed=1), "cpu", ["float32"]
    else:
        from services.common.models.loading import resolve_model_dir
        from services.settings import read_settings
        model_dir = resolve_model_dir("default", Path(read_settings({}).model_cache))
        device, dtypes = "cuda", ["float32", "bfloat16"]
        rows.append(("-", "device", "info", torch.cuda.get_device_name(0), 0.0))
    for dtype in dtypes:
        asyncio.run(check_dtype(model_dir, device, dtype, args.tokens, rows))
    if not args.cpu_smoke and not args.no_kernel_tests:
        from benchmarks.gpu_kernels import run_kernel_tests
        t = time.perf_counter()
        rows.append(("-", "kernel tests, compiled Triton", "PASS" if run_kernel_tests() else "FAIL", "tests/kernels",
                     time.perf_counter() - t))
    print_table(rows)
    failed = [r for r in rows if r[2] == "FAIL"]
    print(f"\ntotal {time.time() - started:.0f} s; {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
