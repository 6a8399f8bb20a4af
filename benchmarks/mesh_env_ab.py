"""Two or more process meshes that differ only in their environment, side by side in one run.

    python -u benchmarks/mesh_env_ab.py --arm screen: --arm noscreen:SPECMESH_ARGMAX_SCREEN=0 \\
        --plans off/1 eagle/4 prompt_lookup/4

Each arm is a whole deployed mesh (draft with the shipped feature head, target and one router per
plan, every service a `specmesh serve` process: benchmarks/eagle_open_text.py's ProcessMesh) whose
processes get the arm's extra variables. The open-text prompts of eagle_open_text.py go one at a
time to every (arm, plan), the order rotated per prompt, so the machine's drift reaches every arm
alike: an A/B of a setting (a kernel switch, a thread setting) through the whole request path
that a one-process micro-benchmark would not show. Greedy, no min_tokens (the answers are the same
tokens under every plan). Reports tokens/s, τ (accepted + bonus tokens per verify pass) and the
CPU other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.eagle_open_text import PROMPTS, ProcessMesh  # noqa: E402
from services.bench.foreign_cpu import ForeignCpu  # noqa: E402
from specmesh.client import NO_RETRIES, AsyncClient  # noqa: E402
from specmesh.proto.v1 import common_pb2, router_service_pb2  # noqa: E402
from tests.mesh import AUTH_A, collect  # noqa: E402

HEAD = ROOT / "services" / "draft" / "eagle" / "heads" / "gemma-3-270m.eagle.safetensors"


def greedy(prompt: str, max_tokens: int) -> router_service_pb2.GenerateRequest:
    return router_service_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="user", content=prompt)],
                                              sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """'NAME:K=V,K=V' -> (NAME, {K: V})."""
    name, _, assignments = text.partition(":")
    env = dict(item.split("=", 1) for item in assignments.split(",") if item)
    return name, env


async def run(arms: list[tuple[str, dict]], plans: list[str], tokens: int, model: str, rounds: int = 1) -> None:
    meshes = {}
    try:
        for name, env in arms:
            mesh = ProcessMesh(model, HEAD, ROOT / "benchmarks" / "results" / "logs" / f"mesh_env_ab_{name}")
            mesh.env.update(env)
            meshes[name] = mesh
            await mesh.start()
        clients = {}
        for name, mesh in meshes.items():
            for plan in plans:
                method, depth = plan.split("/")
                address = await mesh.router(method, int(depth), 0)
                client = AsyncClient(address, retry=NO_RETRIES)
                await client.__aenter__()
                await collect(client, greedy("Hello!", 4), AUTH_A)  # connects the draft stream
                clients[(name, plan)] = client
        keys = list(clients)
        totals = {key: [0, 0.0, 0, 0] for key in keys}  # tokens, seconds, verify passes, accepted
        pids = [os.getpid(), *(p.pid for mesh in meshes.values() for p in mesh.procs)]
        with ForeignCpu(lambda: pids) as foreign:
            for i, prompt in enumerate(tqdm(PROMPTS * rounds, desc="prompts")):
                for key in keys[i % len(keys):] + keys[:i % len(keys)]:
                    start = time.perf_counter()
                    ids, _, last = await collect(clients[key], greedy(prompt, tokens), AUTH_A)
                    row = totals[key]
                    row[0] += len(ids)
                    row[1] += time.perf_counter() - start
                    row[2] += last.usage.verify_passes
                    row[3] += last.usage.accepted_tokens
        print(f"model={model} bf16, greedy, {len(PROMPTS)} prompts x {tokens} tokens x {rounds} rounds, "
              "services in processes")
        print(f"foreign CPU (other processes) during the run: {foreign.share()}")
        print(f"{'arm':<12} {'plan':<18} {'tok/s':>7} {'tau':>5}  env")
        env_of = dict(arms)
        for (name, plan), (n, seconds, passes, accepted) in totals.items():
            tau = f"{1 + accepted / passes:.2f}" if passes else "-"
            print(f"{name:<12} {plan:<18} {n / seconds:>7.1f} {tau:>5}  {env_of[name] or '-'}")
        for client in clients.values():
            await client.__aexit__(None, None, None)
    finally:
        for mesh in meshes.values():
            await mesh.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", action="append", required=True, help="NAME:K=V,K=V (repeat: two or more)")
    parser.add_argument("--plans", nargs="+", default=["off/1", "eagle/4", "prompt_lookup/4"],
                        help="METHOD/DEPTH routers per arm")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=1, help="times through the prompts")
    args = parser.parse_args()
    arms = [parse_arm(a) for a in args.arm]
    if len(arms) < 2 or len({name for name, _ in arms}) != len(arms):
        parser.error("give two or more --arm with distinct names")
    asyncio.run(run(arms, args.plans, args.tokens, args.model, args.rounds))


if __name__ == "__main__":
    main()
