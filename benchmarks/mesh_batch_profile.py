"""Where the 18-request batch goes: every process of the mesh profiled while compare.py's batch runs.

    python -m benchmarks.mesh_batch_profile                 # target + router, 30 s of batches
    python -m benchmarks.mesh_batch_profile --seconds 60 --weights gguf
    python -m benchmarks.mesh_batch_profile --single          # one request at a time instead

Starts a target and a router (`specmesh serve --dev`, speculation off, as compare.py's
`router-off`), warms them with compare.py's nine prompts (so, as in compare.py's batch, the
prompts' prefixes are cached), then runs compare.py's `batch18` again and again while py-spy
samples each process (without pausing it) and
/proc counts each process's CPU seconds. Prints, per process, CPU milliseconds per generated
token, and for the target and the router the share of their busy samples in each part of a
step (the first part, in CATEGORIES order, found in a sample's stack). The client is this
process (an asyncio gRPC client, as in compare.py). Needs py-spy (`pip install py-spy`) and
root or ptrace rights.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.anchors.compare import (ROOT, Specmesh, batch18, make_prompts, single, stop, wait_grpc)
from services.bench.foreign_cpu import ForeignCpu, process_seconds, process_tree
from services.common.env import DEV_TOKEN

PORTS = {"target": 52151, "router": 52161}

# (category, substrings of a frame: "function (file:line)" as py-spy's raw output writes it).
# A sample counts in the first category any of its frames matches, so the specific parts come first.
CATEGORIES = [
    ("argmax screen", ("argmax_screen.py",)),
    ("output layer (lm_head)", ("output_layer.py",)),
    ("linear kernels", ("bf16_linear", "gguf_linear", "cpu_linear", "linear.py", "gguf_weights.py")),
    ("attention", ("paged_attention", "attention.py", "decode_attention", "chunk_attention")),
    ("row ops", ("cpu_rowops", "rms_norm", "qk_norm_rope", "gelu")),
    ("forward, rest", ("gemma3_forward.py", "lean_forward.py", "model_runner")),
    ("sampling", ("sampler.py", "sample_rows.py", "plain_sampling.py", "logprobs.py", "logits_processors.py")),
    ("detokenize", ("detokenizer.py", "special_tokens.py")),
    ("stop matching", ("stop_matcher.py",)),
    ("scheduler and KV blocks", ("scheduler.py", "block_manager.py", "kv_events.py", "step_log.py")),
    ("engine, rest", ("engine.py", "sequence.py", "speculator.py")),
    ("stream to the caller", ("service.py", "relay", "servicer", "_stream")),
    ("protobuf", ("protobuf", "_pb2")),
    ("gRPC", ("grpc",)),
    ("tracing", ("opentelemetry",)),
    ("asyncio", ("asyncio",)),
]


def categorize(stack: str) -> str:
    for name, keys in CATEGORIES:
        if any(k in stack for k in keys):
            return name
    return "other"


def read_raw(path: Path) -> Counter:
    """py-spy's raw (collapsed) output -> samples per category."""
    counts: Counter = Counter()
    if not path.exists():
        return counts
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            counts[categorize(stack)] += int(n)
    return counts


def start_mesh(model: str, weights: str, log_dir: Path) -> dict[str, subprocess.Popen]:
    env = {**os.environ, "SPECMESH_TOKENS": f"{DEV_TOKEN}=bench", "SPECMESH_METRICS_PORT": "0",
           "SPECMESH_WEIGHTS": weights, "SPECMESH_MODEL": model}
    cmd = [sys.executable, "-m", "services.cli", "serve", "--dev"]
    target = subprocess.Popen([*cmd, "target", "--port", str(PORTS["target"])], cwd=ROOT, env=env,
                              stdout=open(log_dir / "target.log", "w"), stderr=subprocess.STDOUT)
    router = subprocess.Popen([*cmd, "router", "--port", str(PORTS["router"]), "--target-address",
                               f"127.0.0.1:{PORTS['target']}", "--speculation-method", "off"], cwd=ROOT, env=env,
                              stdout=open(log_dir / "router.log", "w"), stderr=subprocess.STDOUT)
    return {"target": target, "router": router}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far per process: a service with its children; the client (this process) alone,
    its py-spy children not counted."""
    return {name: process_seconds(pid) if name == "client" else sum(process_seconds(p) for p in process_tree([pid]))
            for name, pid in pids.items()}


async def run(args) -> None:
    if shutil.which("py-spy") is None:
        sys.exit("py-spy is not installed: pip install py-spy")
    from transformers import AutoTokenizer

    from services.common.models.loading import resolve_model_dir
    model_dir = resolve_model_dir(args.model, Path.home() / ".cache" / "specmesh" / "models")
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir))
    out_dir = Path(tempfile.mkdtemp(prefix="mesh-profile-"))
    procs = start_mesh(args.model, args.weights, out_dir)
    try:
        client = Specmesh(PORTS["router"])
        await wait_grpc(f"127.0.0.1:{PORTS['router']}", list(procs.values()))
        print("warming up: the nine prompts one at a time, then one batch")
        await single(client, prompts, args.tokens)
        await batch18(client, prompts, args.tokens)
        pids = {name: p.pid for name, p in procs.items()} | {"client": os.getpid()}
        spies = {}
        for name, pid in pids.items():
            cmd = ["py-spy", "record", "--pid", str(pid), "--rate", str(args.rate), "--format", "raw",
                   "--duration", str(int(args.seconds) + 30), "--output", str(out_dir / f"{name}.txt"),
                   # not pausing the process: a native profile pauses it per sample (the target ran 4x
                   # slower) and counts threads waiting in C as busy; the kernels show by their Python caller
                   "--nonblocking"]
            spies[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(out_dir / f"{name}.spy.log", "w"))
        time.sleep(2)  # py-spy attached
        cpu0 = cpu_seconds(pids)
        limits = [args.tokens * (1 + i % 4) // 4 for i in range(18)]  # batch18's requests, without its pause
        reqs = [prompts[i % len(prompts)] for i in range(18)]
        tokens, batches, start = 0, 0, time.perf_counter()
        with ForeignCpu(lambda: [*pids.values(), *(s.pid for s in spies.values())]) as foreign:
            while time.perf_counter() - start < args.seconds:
                if args.single:  # compare.py's single-stream: one request at a time, the prompts in turn
                    results = [await client.generate(reqs[batches % len(prompts)], args.tokens)]
                else:
                    results = await asyncio.gather(*(client.generate(p, lim) for p, lim in zip(reqs, limits)))
                tokens += sum(r[0] for r in results)
                batches += 1
            wall = time.perf_counter() - start
        cpu1 = cpu_seconds(pids)
        for s in spies.values():
            s.send_signal(2)  # SIGINT: py-spy writes what it has
        for s in spies.values():
            try:
                s.wait(60)
            except subprocess.TimeoutExpired:
                s.kill()
        share = foreign.share()
    finally:
        stop(list(procs.values()))

    what = "single requests" if args.single else "batches of 18 requests"
    print(f"\n{batches} {what} in {wall:.1f} s: {tokens / wall:.1f} tok/s while profiled "
          f"(py-spy at {args.rate} Hz slows it); foreign CPU median {share['median']:.1%}, max {share['max']:.1%}")
    print("\nCPU per generated token, by process (all threads):")
    total = 0.0
    for name in pids:
        ms = (cpu1[name] - cpu0[name]) / tokens * 1000
        total += ms
        print(f"  {name:<8} {ms:6.2f} ms")
    print(f"  {'all':<8} {total:6.2f} ms  (2 cores give {2000 / (tokens / wall):.2f} ms of CPU per token at this rate)")
    for name in pids:
        counts = read_raw(out_dir / f"{name}.txt")
        n = sum(counts.values())
        if not n:
            print(f"\n{name}: no samples (see {out_dir / (name + '.spy.log')})")
            continue
        print(f"\n{name}: {n} busy samples")
        for cat, c in counts.most_common():
            print(f"  {cat:<26} {c / n:6.1%}")
    print(f"\nraw profiles: {out_dir}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", default="default")
    p.add_argument("--weights", default="auto")
    p.add_argument("--tokens", type=int, default=64, help="the batch's longest max_tokens (compare.py's --tokens)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long batches run while profiled")
    p.add_argument("--single", action="store_true", help="one request at a time (single-stream decode)")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
