"""specmesh against vLLM's CPU build, llama.cpp and Hugging Face `generate`, side by side in one run.

    bash benchmarks/anchors/setup_vllm.sh            # once: vLLM in its own venv
    bash benchmarks/anchors/setup_llamacpp.sh        # once: llama-server and the default model's GGUFs
    python benchmarks/anchors/compare.py             # 3 rounds, 64 tokens, default model
    python benchmarks/anchors/compare.py --rounds 1 --skip hf
    python benchmarks/anchors/compare.py --model "$(python benchmarks/llama_family_checkpoints.py qwen2.5-0.5b)"
        # a random-weight checkpoint of a published Llama-family shape (also llama-3.2-1b, qwen3-0.6b)

Same nine prompts (14 .. 1,508 tokens) for every system, bf16, greedy, systems interleaved
within each round, medians over rounds:
  * single: the nine prompts one after another, decode tok/s ((tokens - 1) / time after the first)
  * batch18: 18 concurrent requests (the nine prompts twice, max_tokens 16/32/48/64), tok/s in all
  * cold prefill: TTFT of a ~2,000-token prompt never seen before; cached: the same prompt again
  * speculation at depth 5 and 10: specmesh prompt lookup vs vLLM n-gram, single-stream tok/s
specmesh runs through the mesh (router -> target, draft service for speculation), each
service a `specmesh serve` subprocess (services/builders.py assembles them); vLLM is
its OpenAI server with Intel OpenMP preloaded (one server per speculation setting, started in
turn). llama.cpp (default model only, no speculation) is `llama-server -t 2 -np 18` on the
default model's own Q4_K_M GGUF and on its BF16 requantization, two systems, each server
started for its turn in a round and stopped after it (one llama-server at a time). vLLM's
worker busy-polls about a second after each request, so every measurement is
preceded by a pause. Writes JSON, markdown and a plot of specmesh's speed relative to vLLM
(each round's ratio, since both systems ran minutes apart within a round) to benchmarks/results/,
and prints the table. Every measurement records the CPU share used by processes outside the
systems under test (services/bench/foreign_cpu.py); a round above 5% is void: left out of
the medians and the ratios, and a row with no clean round says "void" instead of a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.bench.foreign_cpu import VOID_SHARE, ForeignCpu  # noqa: E402
from services.common.env import DEV_TOKEN  # noqa: E402
from specmesh.client import NO_RETRIES, AsyncClient  # noqa: E402
from specmesh.proto.v1 import common_pb2, router_service_pb2  # noqa: E402

LENGTHS = [14, 40, 90, 180, 300, 500, 750, 1100, 1508]
PAUSE_S = 1.5  # vLLM's worker busy-polls ~1 s after a request
PORTS = {"target": 52051, "draft": 52052, "router-off": 52061, "router-5": 52065, "router-10": 52070,
         "target-variant": 52053, "router-variant": 52062}
VLLM_PORT = 52080
LLAMACPP_PORT = 52090
LLAMACPP_VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors the llama.cpp sources (setup_llamacpp.sh)
LLAMACPP_PARALLEL = 18  # llama-server's slots: the batch's 18 requests at once
# System name -> the GGUF it serves, in the setup script's models/ folder.
LLAMACPP_GGUF = {"llama.cpp BF16": "gemma-3-270m-bf16.gguf", "llama.cpp Q4_K_M": "gemma-3-270m-q4_k_m.gguf"}
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil "
    "and a notebook in which he wrote the weather, the ships he saw and the state of the lamp. "
    "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n"
    "Summarize the following report in three sentences, keeping every number exact. "
    "In 1887 the harbour saw 412 ships; in 1888, 455; the storm of March 1889 closed it for 19 days. "
)


def make_prompts(tokenizer) -> list[str]:
    """Nine prompts of LENGTHS tokens (copy-heavy text, so prompt lookup has something to match)."""
    ids = tokenizer(TEXT * 80, add_special_tokens=False).input_ids
    out = []
    for i, n in enumerate(LENGTHS):
        start = (i * 37) % 200
        out.append(tokenizer.decode(ids[start:start + n - 1]))  # + BOS = n tokens
    return out


# ---------------------------------------------------------------- clients
class Specmesh:
    def __init__(self, port: int) -> None:
        self.address = f"127.0.0.1:{port}"

    async def generate(self, prompt: str, max_tokens: int) -> tuple[int, float, float]:
        """(tokens, seconds to first token, seconds in all)."""
        async with AsyncClient(self.address, DEV_TOKEN, retry=NO_RETRIES) as client:
            req = router_service_pb2.GenerateRequest(
                prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
            start, first, n = time.perf_counter(), None, 0
            async for resp in client.stream(req):
                if resp.chunk.token_ids:
                    first = first or time.perf_counter()
                    n += len(resp.chunk.token_ids)
            return n, (first or time.perf_counter()) - start, time.perf_counter() - start


class VLLM:
    extra: dict = {}  # more fields of the request body

    def __init__(self, port: int, model: str) -> None:
        self.url, self.model = f"http://127.0.0.1:{port}/v1/completions", model
        # Its own threads, one per request of the batch: asyncio's default pool has cpu_count + 4
        # (6 here), which would let only 6 of the 18 "concurrent" requests be in flight at once.
        self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="http-client")
        self.cached_tokens: list[int | None] = []  # per request: prompt tokens the server found cached, if told

    async def generate(self, prompt: str, max_tokens: int) -> tuple[int, float, float]:
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._generate, prompt, max_tokens)

    def _generate(self, prompt: str, max_tokens: int) -> tuple[int, float, float]:
        return self.complete({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})[:3]

    def complete(self, fields: dict) -> tuple[int, float, float, str, str | None]:
        """One streamed completion whose body has `fields` (and `extra`): (tokens, seconds to the
        first token, seconds in all, text, finish reason)."""
        body = json.dumps({"model": self.model, "stream": True,
                           "stream_options": {"include_usage": True}} | fields | self.extra).encode()
        req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        start, first, n, text, finish = time.perf_counter(), None, 0, "", None
        with urllib.request.urlopen(req, timeout=600) as resp:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                # The first token's message, even where its text is empty (a random-weight
                # checkpoint's tokens often decode to nothing; waiting for text measured ~0 s of decode).
                if msg.get("choices") and not msg["choices"][0].get("finish_reason"):
                    first = first or time.perf_counter()
                for choice in msg.get("choices") or ():
                    text += choice.get("text") or ""
                    finish = choice.get("finish_reason") or finish
                if msg.get("usage"):
                    n = msg["usage"]["completion_tokens"]
                    self.cached_tokens.append((msg["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"))
        return n, (first or time.perf_counter()) - start, time.perf_counter() - start, text, finish


class LlamaCpp(VLLM):
    """llama-server's OpenAI-compatible /v1/completions (the same stream; usage in its last
    message). Its prompt cache is a per-slot common prefix: `cache_prompt` (on by default,
    said here because the cached-prefix row measures it); the cold prompt's unique first
    token leaves nothing but BOS in common."""
    extra = {"cache_prompt": True}


class HF:
    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    async def generate(self, prompt: str, max_tokens: int) -> tuple[int, float, float]:
        ids = self.tokenizer(prompt, return_tensors="pt")
        start = time.perf_counter()
        with self.torch.inference_mode():
            self.model.generate(**ids, max_new_tokens=1, do_sample=False)
            first = time.perf_counter() - start
            out = self.model.generate(**ids, max_new_tokens=max_tokens, do_sample=False) if max_tokens > 1 else None
        n = out.shape[1] - ids.input_ids.shape[1] if out is not None else 1
        return n, first, time.perf_counter() - start - first  # the second call re-does the prefill

    async def batch(self, prompts: list[str], limits: list[int]) -> float:
        self.tokenizer.padding_side = "left"
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True)
        start = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=max(limits), do_sample=False)
        new = out[:, enc.input_ids.shape[1]:]
        useful = sum(min(int((row != self.tokenizer.pad_token_id).sum()), lim) for row, lim in zip(new, limits))
        return useful / (time.perf_counter() - start)


# ---------------------------------------------------------------- scenarios
async def single(client, prompts: list[str], tokens: int) -> float:
    """Decode tok/s over the prompts, one at a time: (tokens - 1) / (time after the first token)."""
    n_sum = t_sum = 0.0
    for p in prompts:
        time.sleep(PAUSE_S)
        n, ttft, total = await client.generate(p, tokens)
        if isinstance(client, HF):  # total already excludes the first token's prefill
            n_sum, t_sum = n_sum + n, t_sum + total
        else:
            n_sum, t_sum = n_sum + n - 1, t_sum + total - ttft
    return n_sum / t_sum


async def batch18(client, prompts: list[str], tokens: int) -> float:
    limits = [tokens * (1 + i % 4) // 4 for i in range(18)]
    reqs = [prompts[i % len(prompts)] for i in range(18)]
    time.sleep(PAUSE_S)
    if isinstance(client, HF):
        return await client.batch(reqs, limits)
    start = time.perf_counter()
    results = await asyncio.gather(*(client.generate(p, lim) for p, lim in zip(reqs, limits)))
    return sum(r[0] for r in results) / (time.perf_counter() - start)


async def prefill(client, prompt: str) -> tuple[float, float]:
    """(cold TTFT, cached TTFT) of one prompt never sent before, then sent again."""
    time.sleep(PAUSE_S)
    cold = (await client.generate(prompt, 1))[1]
    time.sleep(PAUSE_S)
    cached = (await client.generate(prompt, 1))[1]
    return cold, cached


# ---------------------------------------------------------------- servers
GENERIC = "transformers' modules:SPECMESH_FORWARD=generic"  # --generic: the lean forward against the generic path


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'LABEL:K=V,K=V' -> (LABEL, {K: V}): a second specmesh target's name in the report and the
    environment it differs by (the mesh's settings, e.g. SPECMESH_KV_DTYPE=float32)."""
    label, sep, assignments = text.partition(":")
    items = [item for item in assignments.split(",") if item]
    if not label or not sep or not items or any("=" not in item for item in items):
        raise ValueError(f"--variant wants LABEL:NAME=VALUE[,NAME=VALUE...], got {text!r}")
    return label, dict(item.split("=", 1) for item in items)


def start_specmesh(model: str, log_dir: Path, weights: str = "auto",
                   variant: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """The mesh (draft, target, one router per speculation setting); with `variant` (environment
    settings), also a second target with those settings behind its own router, measured beside
    the first in every round at depth 0: an A/B of one setting against the anchors' run (the
    generic path, `--generic`, or an earlier default)."""
    env = {**os.environ, "SPECMESH_TOKENS": f"{DEV_TOKEN}=bench", "SPECMESH_METRICS_PORT": "0",
           "SPECMESH_WEIGHTS": weights,
           "SPECMESH_MODEL": model}
    cmd = [sys.executable, "-m", "services.cli", "serve", "--dev"]  # plaintext on loopback
    variant_procs = []
    if variant:
        variant_procs = [
            subprocess.Popen([*cmd, "target", "--port", str(PORTS["target-variant"])], cwd=ROOT,
                             env={**env, **variant},
                             stdout=open(log_dir / "target-variant.log", "w"), stderr=subprocess.STDOUT),
            subprocess.Popen([*cmd, "router", "--port", str(PORTS["router-variant"]), "--target-address",
                              f"127.0.0.1:{PORTS['target-variant']}", "--speculation-method", "off"],
                             cwd=ROOT, env=env, stdout=open(log_dir / "router-variant.log", "w"),
                             stderr=subprocess.STDOUT)]
    procs = [subprocess.Popen([*cmd, "draft", "--port", str(PORTS["draft"])], cwd=ROOT, env=env,
                              stdout=open(log_dir / "draft.log", "w"), stderr=subprocess.STDOUT),
             subprocess.Popen([*cmd, "target", "--port", str(PORTS["target"]),
                               "--draft-address", f"127.0.0.1:{PORTS['draft']}"], cwd=ROOT, env=env,
                              stdout=open(log_dir / "target.log", "w"), stderr=subprocess.STDOUT)]
    for name, method, depth in (("router-off", "off", 5), ("router-5", "prompt_lookup", 5),
                                ("router-10", "prompt_lookup", 10)):
        procs.append(subprocess.Popen(
            [*cmd, "router", "--port", str(PORTS[name]), "--target-address", f"127.0.0.1:{PORTS['target']}",
             "--speculation-method", method, "--speculation-depth", str(depth),
             "--speculation-policy", "fixed"], cwd=ROOT, env=env,  # the depth compared, every step
            stdout=open(log_dir / f"{name}.log", "w"), stderr=subprocess.STDOUT))
    return procs + variant_procs


def start_vllm(venv: Path, model_dir: Path, depth: int, log_dir: Path, extra_args: tuple[str, ...] = (),
               log_name: str = "") -> subprocess.Popen:
    """vLLM's OpenAI server on VLLM_PORT; n-gram speculation at `depth` (0: off); `extra_args`
    go on its command line; its log is `log_name` (default vllm-DEPTH.log) in `log_dir`."""
    py = venv / "bin" / "python"
    # Two OpenMP threads bound to cores 0-1 (its default binds one core and reserves the other).
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    iomp = next(iter((venv / "lib").glob("libiomp5.so")), None)
    if iomp is not None:
        env["LD_PRELOAD"] = str(iomp)
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "gemma", "--dtype", "bfloat16", "--port", str(VLLM_PORT),
           "--max-model-len", "4096", "--max-num-seqs", "32"]
    if depth:
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": depth,
                                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2})]
    log = open(log_dir / (log_name or f"vllm-{depth}.log"), "w")
    return subprocess.Popen([*cmd, *extra_args], env=env, stdout=log, stderr=subprocess.STDOUT)


def llamacpp_files(directory: Path) -> tuple[Path, dict[str, Path]]:
    """llama-server and, per llama.cpp system, the GGUF it serves, where setup_llamacpp.sh puts them."""
    return (directory / "build" / "bin" / "llama-server",
            {name: directory / "models" / gguf for name, gguf in LLAMACPP_GGUF.items()})


def llamacpp_missing(directory: Path) -> str:
    """What setup_llamacpp.sh has not yet put in `directory` ("" when all is there)."""
    server, ggufs = llamacpp_files(directory)
    missing = [p for p in (server, *ggufs.values()) if not p.is_file()]
    return f"{missing[0]} is missing" if missing else ""


def llamacpp_context(longest_prompt: int, tokens: int, parallel: int = LLAMACPP_PARALLEL) -> int:
    """llama-server's -c: without a unified KV cache (-np given) it splits the context evenly
    over its slots, so each slot must hold the longest prompt and its tokens (plus a margin for
    tokenizing the text again), rounded up to 256."""
    per_slot = -(-(longest_prompt + tokens + 16) // 256) * 256
    return parallel * per_slot


def start_llamacpp(server: Path, gguf: Path, context: int, log: Path, repack: bool = True) -> subprocess.Popen:
    cmd = [str(server), "-m", str(gguf), "--alias", "gemma", "--host", "127.0.0.1", "--port", str(LLAMACPP_PORT),
           "-t", "2", "-np", str(LLAMACPP_PARALLEL), "-c", str(context), "--no-webui"] + ([] if repack else ["-nr"])
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)


SPECMESH_SWITCHES = ("SPECMESH_ARGMAX_SCREEN", "SPECMESH_HUGE_PAGES", "SPECMESH_AMX")
LLAMACPP_NOTES: list[str] = []  # what the report must say about how llama.cpp ran (start_llamacpp_ready)


def start_llamacpp_ready(system: str, server: Path, gguf: Path, context: int, log: Path) -> subprocess.Popen:
    """llama-server up and answering. Where it dies of a signal while starting, once more without
    its weight repacking (`--no-repack`): on a 2-core Xeon with AMX (2026-12-05) llama.cpp's repack
    of the Q4_K_M file segfaulted at start; the report says so, since its repacked kernels are faster."""
    proc = start_llamacpp(server, gguf, context, log)
    try:
        wait_http(f"http://127.0.0.1:{LLAMACPP_PORT}/health", proc)
        return proc
    except RuntimeError:
        if proc.returncode is None or proc.returncode >= 0:
            raise
    proc = start_llamacpp(server, gguf, context, log, repack=False)
    try:
        wait_http(f"http://127.0.0.1:{LLAMACPP_PORT}/health", proc)
    except RuntimeError:
        stop([proc])
        raise
    note = f"{system} crashed while starting with weight repacking and ran with --no-repack"
    if note not in LLAMACPP_NOTES:
        LLAMACPP_NOTES.append(note)
    return proc


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see its log")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except Exception:
            time.sleep(2)
    raise TimeoutError(url)


async def wait_grpc(address: str, procs: list[subprocess.Popen], timeout: float = 600) -> None:
    client = Specmesh(int(address.rsplit(":", 1)[1]))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a specmesh service exited; see benchmarks/results/logs/")
        try:
            await client.generate("hello", 1)
            return
        except grpc.aio.AioRpcError:
            await asyncio.sleep(2)
    raise TimeoutError(address)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


# ---------------------------------------------------------------- main
async def run(args, llamacpp: Path | None = None) -> dict:
    """`llamacpp`: the folder setup_llamacpp.sh filled, or None to leave llama.cpp out."""
    from transformers import AutoTokenizer

    from services.common.models.loading import resolve_model_dir
    model_dir = resolve_model_dir(args.model, Path.home() / ".cache" / "specmesh" / "models")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tokenizer)[:args.prompts]
    long_ids = tokenizer(TEXT * 60, add_special_tokens=False).input_ids[:args.prefill_tokens]
    log_dir = ROOT / "benchmarks" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, dict[str, list[float]]] = {}
    foreign: dict[str, dict[str, list[float]]] = {}  # metric -> system -> each measurement's foreign CPU share

    variant_label, variant_env = parse_variant(args.variant) if args.variant else (None, None)
    procs = start_specmesh(args.model, log_dir, args.specmesh_weights, variant_env)
    vllm_proc = llama_proc = None
    # The systems under test: this process (HF runs in it, and the clients), the mesh's
    # services, the vLLM server, the llama-server up now; every other process's CPU is foreign.
    cpu = ForeignCpu(lambda: [os.getpid(), *(p.pid for p in procs),
                              *(p.pid for p in (vllm_proc, llama_proc) if p is not None)], interval_s=0.5)
    if llamacpp is not None:
        longest = max([len(tokenizer(p).input_ids) for p in prompts] + [args.prefill_tokens + 2])
        llama_context = llamacpp_context(longest, args.tokens)
        llama_server, llama_gguf = llamacpp_files(llamacpp)
        llama = {name: LlamaCpp(LLAMACPP_PORT, "gemma") for name in LLAMACPP_GGUF}
    else:
        llama = {}

    async def measured(run_it):
        """(what `run_it` returns, the foreign CPU share while it ran)."""
        start = time.monotonic()
        value = await run_it
        # Padded by one sample: a measurement shorter than the interval still gets one.
        share = cpu.share(start - cpu.interval_s, time.monotonic() + cpu.interval_s)["median"]
        return value, share if share is not None else 0.0

    def note(system: str, metric: str, value: float, share: float) -> None:
        res.setdefault(metric, {}).setdefault(system, []).append(value)
        foreign.setdefault(metric, {}).setdefault(system, []).append(share)

    hf = HF(model_dir) if "hf" not in args.skip else None
    cpu.__enter__()
    try:
        for name in ("router-off", "router-5", "router-10") + (("router-variant",) if variant_env else ()):
            await wait_grpc(f"127.0.0.1:{PORTS[name]}", procs)
        mesh = {d: Specmesh(PORTS[f"router-{d}" if d else "router-off"]) for d in (0, 5, 10)}
        variant = Specmesh(PORTS["router-variant"]) if variant_env else None
        phases = [0] if "speculation" in args.skip else [0, 5, 10]
        anchor = "vllm" not in args.skip  # vLLM runs in every phase, HF, the variant and llama.cpp at depth 0
        total = args.rounds * (1 + anchor + (hf is not None) + (variant is not None) + len(llama)
                               + (len(phases) - 1) * (1 + anchor))
        bar = tqdm(total=total, desc="measurements")
        for depth in phases:
            vllm_proc = None
            if "vllm" not in args.skip:
                vllm_proc = start_vllm(Path(args.vllm_venv).expanduser(), model_dir, depth, log_dir)
                wait_http(f"http://127.0.0.1:{VLLM_PORT}/health", vllm_proc)
            vllm = VLLM(VLLM_PORT, "gemma") if vllm_proc else None
            try:
                systems = [("vLLM", vllm), ("specmesh", mesh[depth])] + (
                    [("HF", hf), ("variant", variant), *llama.items()] if depth == 0 else [])
                for _, client in systems:  # one unmeasured request each: first-call setup is not serving
                    if client is not None and not isinstance(client, LlamaCpp):  # (llama.cpp: at its start)
                        await client.generate(prompts[0], 8)
                for r in range(args.rounds):
                    for system, client in systems:
                        if client is None:
                            continue
                        if depth:
                            note(system, f"spec{depth}", *await measured(single(client, prompts, args.tokens)))
                            bar.update(1)
                            continue
                        try:
                            if isinstance(client, LlamaCpp):  # its server up for its turn only
                                llama_proc = start_llamacpp_ready(system, llama_server, llama_gguf[system],
                                                                  llama_context, log_dir / f"{system.replace(' ', '-')}.log")
                                await client.generate(prompts[0], 8)
                            note(system, "single", *await measured(single(client, prompts, args.tokens)))
                            note(system, "batch18", *await measured(batch18(client, prompts, args.tokens)))
                            first = (1000 + 97 * r + len(system)) % len(tokenizer)  # new per round & system
                            text = tokenizer.decode([first] + long_ids)
                            (cold, cached), share = await measured(prefill(client, text))
                            note(system, "cold_ttft", cold, share)
                            note(system, "cached_ttft", cached, share)
                            if isinstance(client, LlamaCpp):  # its own word on what its prompt cache held
                                bar.write(f"{system} round {r + 1}: prompt tokens it found cached, cold prefill "
                                          f"{client.cached_tokens[-2]}, cached prefix {client.cached_tokens[-1]} "
                                          f"(llama-server -c {llama_context})")
                        finally:
                            if llama_proc is not None:
                                stop([llama_proc])
                                llama_proc = None
                        bar.update(1)
            finally:
                if vllm_proc:
                    stop([vllm_proc])
                    time.sleep(3)
            (log_dir / "partial.json").write_text(json.dumps(res, indent=1))  # survives an interrupted run
        bar.close()
    finally:
        cpu.__exit__(None, None, None)
        stop(procs)
    result = summarize(res, foreign)
    result["_weights"] = served_weights(log_dir / "target.log")
    if variant_label:
        result["_variant"] = variant_label
    return result


def served_weights(target_log: Path) -> str | None:
    """The weight format the target resolved (`auto` depends on the CPU and the model), from its log."""
    for line in target_log.read_text(errors="replace").splitlines():
        if "linear layers: " in line:
            return line.split("linear layers: ", 1)[1].split(" ", 1)[0]
    return None


def summarize(res: dict[str, dict[str, list[float]]], foreign: dict | None = None) -> dict:
    """metric -> system -> median over its clean rounds (foreign CPU share at most VOID_SHARE),
    plus "_all": every round's value per system, "_foreign": every round's foreign share,
    "_void": systems with no clean round (their median is over all rounds, and no ratio is
    stated from them)."""
    foreign = foreign or {}
    out = {}
    for metric, by in res.items():
        shares = foreign.get(metric, {})
        medians, void = {}, []
        for system, values in by.items():
            clean = [v for v, f in zip(values, shares.get(system, [0.0] * len(values))) if f <= VOID_SHARE]
            if not clean:
                void.append(system)
            medians[system] = statistics.median(clean or values)
        out[metric] = medians | {"_all": by, "_foreign": shares, "_void": sorted(void)}
    return out


ROWS = [("single", "single-stream decode, tok/s", True), ("batch18", "18 concurrent requests, tok/s in all", True),
        ("cold_ttft", "cold prefill of a ~2,000-token prompt, TTFT s", False),
        ("cached_ttft", "cached prefix, same prompt, TTFT s", False),
        ("spec5", "speculation depth 5 (specmesh prompt lookup / vLLM n-gram), tok/s", True),
        ("spec10", "speculation depth 10, tok/s", True)]


SHORT = {"single": "single-stream decode", "batch18": "18 mixed requests", "cold_ttft": "cold prefill, ~2,000 tokens",
         "cached_ttft": "cached prefix", "spec5": "speculation, depth 5", "spec10": "speculation, depth 10"}
GOALS = {"single": 1.0, "batch18": 1.0, "cold_ttft": 1.0, "spec5": 1.3, "spec10": 1.3}  # the goals the side-by-side run is held to


def round_ratios(result: dict, key: str, higher: bool) -> list[float]:
    """specmesh's speed relative to vLLM in each round (> 1: specmesh faster). Both systems ran
    minutes apart within a round, so a round's ratio drifts less with the host's load than the
    ratio of medians taken over the whole run."""
    runs = result.get(key, {}).get("_all", {})
    shares = result.get(key, {}).get("_foreign", {})
    pairs = zip(runs.get("vLLM", []), runs.get("specmesh", []),
                shares.get("vLLM", [0.0] * 99), shares.get("specmesh", [0.0] * 99))
    # A round where either system shared the machine with more than VOID_SHARE is void.
    return [s / v if higher else v / s for v, s, fv, fs in pairs if v and s and max(fv, fs) <= VOID_SHARE]


def speed_ratio(m: dict, other: str, higher: bool) -> float | str | None:
    """specmesh's speed over `other`'s from one row's medians (> 1: specmesh faster): "void"
    when either has no clean round (foreign CPU), None when either was not measured."""
    o, s = m.get(other), m.get("specmesh")
    if not (o and s):
        return None
    if {other, "specmesh"} & set(m.get("_void", [])):
        return "void"
    return s / o if higher else o / s


def table(result: dict) -> str:
    variant = any("variant" in result.get(key, {}) for key, _, _ in ROWS)
    variant_label = result.get("_variant", "variant")
    llama = [x for x in LLAMACPP_GGUF if any(x in result.get(key, {}) for key, _, _ in ROWS)]
    shown = ["vLLM", "specmesh", "HF", *llama]  # the foreign CPU column, in this order
    lines = ["| | vLLM | specmesh (through the mesh) | per round | HF `generate` |"
             + "".join(f" {x} (specmesh / it) |" for x in llama)
             + f" foreign CPU (median: {' / '.join(shown)}) |"
             + (f" specmesh, {variant_label} (specmesh / it) |" if variant else ""),
             "|---|---|---|---|---|---|" + "---|" * len(llama) + ("---|" if variant else "")]
    for key, label, higher in ROWS:
        m = result.get(key, {})
        v, s, h, g = m.get("vLLM"), m.get("specmesh"), m.get("HF"), m.get("variant")
        fmt = (lambda x: "—" if x is None else (f"{x:.1f}" if higher else f"{x:.3f}"))
        ratio = speed_ratio(m, "vLLM", higher)
        ratio = ("" if ratio is None else " (void: foreign CPU)" if ratio == "void"
                 else f" ({ratio:.2f}x)" if higher else f" ({ratio:.2f}x vLLM's speed)")
        shares = m.get("_foreign", {})
        share = " / ".join(f"{statistics.median(shares[x]):.1%}" if shares.get(x) else "—" for x in shown)
        per_round = round_ratios(result, key, higher)
        band = (f"{min(per_round):.2f}–{max(per_round):.2f}x" if len(per_round) > 1
                else f"{per_round[0]:.2f}x" if per_round else "—")
        anchors = ""
        for x in llama:
            r = speed_ratio(m, x, higher)
            anchors += f" {fmt(m.get(x))}" + ("" if r is None else " (void: foreign CPU)" if r == "void"
                                              else f" ({r:.2f}x)") + " |"
        gain = speed_ratio(m, "variant", higher)
        gain = "" if gain is None else " (void: foreign CPU)" if gain == "void" else f" ({gain:.2f}x)"
        lines.append(f"| {label} | {fmt(v)} | {fmt(s)}{ratio} | {band} | {fmt(h)} |{anchors} {share} |"
                     + (f" {fmt(g)}{gain} |" if variant else ""))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    """specmesh's speed relative to vLLM per metric: each round a dot, the median a bar, the
    goal a tick. None when matplotlib is missing (`pip install -e .[bench]`)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [(key, SHORT[key], round_ratios(result, key, higher)) for key, _, higher in ROWS]
    rows = [r for r in rows if r[2]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.2))
    for y, (key, label, ratios) in enumerate(rows):
        ax.scatter(ratios, [y] * len(ratios), color="tab:blue", zorder=3, label="a round" if y == 0 else None)
        ax.plot([statistics.median(ratios)] * 2, [y - 0.3, y + 0.3], color="tab:blue", lw=3,
                label="median of the rounds" if y == 0 else None)
        if key in GOALS:
            ax.plot([GOALS[key]] * 2, [y - 0.35, y + 0.35], color="tab:red", lw=1.5, ls="--",
                    label="goal" if y == 0 else None)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_yticks(range(len(rows)), [label for _, label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("specmesh / vLLM, speed (> 1: specmesh faster)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def use_llamacpp(args) -> Path | None:
    """The folder setup_llamacpp.sh filled when llama.cpp is to run, else None with a line saying why not."""
    if "llamacpp" in args.skip:
        return None
    if args.model != "default":
        print("llama.cpp: left out; it serves the default model's own GGUF files only (--model default)")
        return None
    directory = Path(args.llamacpp_dir).expanduser()
    if missing := llamacpp_missing(directory):
        print(f"llama.cpp: left out, {missing}; run `bash benchmarks/anchors/setup_llamacpp.sh` once "
              "(or --skip llamacpp to say so)")
        return None
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=9, help="how many of the nine prompts (single-stream runs)")
    parser.add_argument("--prefill-tokens", type=int, default=2000)
    parser.add_argument("--skip", nargs="*", default=[], choices=["vllm", "llamacpp", "hf", "speculation"])
    parser.add_argument("--specmesh-weights", default="auto", choices=["auto", "bf16", "bf16-avx512", "gguf", "gguf-bf16", "int8"],
                        help="specmesh's linear layers (SPECMESH_WEIGHTS); gguf: the default model's own GGUF "
                             "blocks (the logits of bf16-avx512, fewer bytes a token); int8 trades accuracy for "
                             "speed (README: greedy agreement and log-prob gap), vLLM and HF stay bf16")
    parser.add_argument("--variant", default="",
                        help="LABEL:NAME=VALUE[,...]: also run a second specmesh target with these settings "
                             "(e.g. 'float32 KV:SPECMESH_KV_DTYPE=float32'), side by side in every round")
    parser.add_argument("--generic", action="store_const", dest="variant", const=GENERIC,
                        help="the variant with transformers' own modules (--forward generic): the lean forward's gain")
    parser.add_argument("--vllm-venv", default=os.environ.get("SPECMESH_VLLM_VENV",
                                                             "~/.cache/specmesh/vllm-venv"))
    parser.add_argument("--llamacpp-dir", default=os.environ.get("SPECMESH_LLAMACPP_DIR", "~/.cache/specmesh/llamacpp"),
                        help="where setup_llamacpp.sh put llama-server and the GGUFs")
    args = parser.parse_args()
    llamacpp = use_llamacpp(args)
    result = asyncio.run(run(args, llamacpp))
    md = table(result)
    load = os.getloadavg()
    # specmesh's switches that change what it runs, as this run's environment set them (README settings)
    switches = {k: v for k, v in os.environ.items() if k in SPECMESH_SWITCHES}
    served = result.get("_weights")
    header = (f"model={args.model} bf16 (specmesh weights: {args.specmesh_weights}"
              + (f" -> {served}" if served and served != args.specmesh_weights else "")
              + "".join(f", {k}={v}" for k, v in sorted(switches.items()))
              + f") greedy tokens={args.tokens} "
              f"rounds={args.rounds} prompts={args.prompts} "
              f"(medians); load average during the run ended at {load[0]:.1f} on {os.cpu_count()} cores"
              + (f"; llama.cpp: llama-server -t 2 -np {LLAMACPP_PARALLEL} from the llama-cpp-python "
                 f"{LLAMACPP_VERSION} sdist's sources, greedy, on the default model's Q4_K_M GGUF and its BF16 "
                 "requantization" if llamacpp else "")
              + "".join(f"; {n}" for n in LLAMACPP_NOTES))
    out = ROOT / "benchmarks" / "results"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"compare-{stamp}.json").write_text(json.dumps({"args": vars(args), "switches": switches, "result": result},
                                                                 indent=1))
    png = plot(result, out / f"compare-{stamp}.png")
    figure = f"\n![specmesh / vLLM per round](compare-{stamp}.png)\n" if png else ""
    (out / f"compare-{stamp}.md").write_text(header + "\n\n" + md + "\n" + figure)
    print(header)
    print(md)
    if png:
        print(f"plot: {png}")


if __name__ == "__main__":
    main()
