"""The feature head (EAGLE) on open text, through the whole mesh, side by side in one run.

    python benchmarks/eagle_open_text.py --head services/draft/eagle/heads/gemma-3-270m.eagle.safetensors

Starts draft (with the head) + target + router gRPC servers on loopback (default model, bf16;
in this process, or with --processes each a `specmesh serve` process of its own) and sends open-text chat requests (questions, stories, explanations, advice: none copies its
prompt; none is in the head's training prompts) one at a time with speculation off, prompt
lookup and the head, greedy and at T=0.8 (each prompt with every plan in turn); then 16 at once with speculation off and the head
under the adaptive policy, in rounds where the two take turns (the spread across rounds is the
noise floor). Reports tokens/s, τ (accepted + bonus tokens per verify pass) and
accepted tokens per pass; the head's cost per draft token against a target decode step; and the
CPU other processes used meanwhile (ratios from a loaded machine mean little).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for tests.mesh helpers

from services.bench.foreign_cpu import ForeignCpu  # noqa: E402
from services.common.models.loading import resolve_model_dir  # noqa: E402
from services.common.server import ServerConfig  # noqa: E402
from services.router.app import build_router_server  # noqa: E402
from services.router.config import RouterConfig  # noqa: E402
from services.settings import read_settings  # noqa: E402
from services.target.config import EngineConfig  # noqa: E402
from services.target.engine.engine import Engine  # noqa: E402
from services.target.server.app import build_target_server  # noqa: E402
from specmesh.client import NO_RETRIES, AsyncClient  # noqa: E402
from specmesh.proto.v1 import common_pb2, router_service_pb2  # noqa: E402
from tests.mesh import AUTH_A, TOKEN_A, collect  # noqa: E402

# Open text, not in services/draft/eagle/data.py's training prompts (other subjects and forms).
PROMPTS = (
    "What are some good ways to spend a rainy weekend at home?",
    "Can you explain how vaccines train the immune system?",
    "Write a short story about a clockmaker who builds a clock that runs backwards.",
    "I have a job interview tomorrow. How should I prepare?",
    "Why is the sky blue during the day and red at sunset?",
    "Tell me about the history of the printing press.",
    "What should I think about before adopting a dog?",
    "Describe a perfect morning in a mountain village.",
    "How do solar panels turn sunlight into electricity?",
    "Write a bedtime story about a turtle who wants to fly.",
    "What are the main differences between a violin and a cello?",
    "Give me tips for learning a new language as an adult.",
)
PLANS = {  # label -> (method, depth, nodes)
    "off": ("off", 1, 0),
    "prompt lookup d4": ("prompt_lookup", 4, 0),
    "eagle d2": ("eagle", 2, 0),
    "eagle d4": ("eagle", 4, 0),
    "eagle d4 tree 6": ("eagle", 4, 6),
    "eagle d4 tree 8": ("eagle", 4, 8),
    "eagle d4 tree 12": ("eagle", 4, 12),
}
DEFAULT_PLANS = ("off", "prompt lookup d4", "eagle d2", "eagle d4", "eagle d4 tree 12")


@dataclass
class Row:
    plan: str
    temperature: float
    tokens: int
    seconds: float
    passes: int = 0
    accepted: int = 0
    round: int = 0  # the concurrent part's round


def chat(prompt: str, max_tokens: int, temperature: float, seed: int) -> router_service_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens)  # equal lengths
    if temperature:
        sampling.temperature, sampling.seed, sampling.has_seed = temperature, seed, True
    return router_service_pb2.GenerateRequest(messages=[common_pb2.ChatMessage(role="user", content=prompt)],
                                              sampling=sampling)


def _row(plan: str, temperature: float, ids: list[int], seconds: float, last) -> Row:
    u = last.usage
    return Row(plan, temperature, len(ids), seconds, u.verify_passes, u.accepted_tokens)


class InProcessMesh:
    """Draft (with the head), target and routers as gRPC servers of this process."""

    def __init__(self, model_dir: Path, head: Path) -> None:
        self.model_dir, self.head = model_dir, head
        self.servers: list = []

    async def start(self) -> None:
        from services.draft.app import build_draft_server
        from services.draft.config import DraftConfig
        self.draft = build_draft_server(DraftConfig(server=ServerConfig(port=0), draft_model_dtype="bfloat16",
                                                    eagle_head_path=self.head, eagle_target_dir=self.model_dir))
        await self.draft.start()
        engine = Engine.load(EngineConfig(model_dir=self.model_dir, dtype="bfloat16", num_blocks=2048,
                                          draft_address=self.draft.address))
        self.target = build_target_server(ServerConfig(port=0), engine, "default")
        await self.target.start()

    async def router(self, method: str, depth: int, nodes: int, policy: str = "fixed") -> str:
        router = build_router_server(ServerConfig(port=0), RouterConfig(
            target_address=self.target.address, tokens={TOKEN_A: "bench"}, speculation_method=method,
            speculation_depth=depth, speculation_nodes=nodes, speculation_policy=policy))
        await router.start()
        self.servers.append(router)
        return router.address

    def pids(self) -> list[int]:
        return [os.getpid()]

    async def stop(self) -> None:
        for server in [*self.servers, self.target, self.draft]:
            await server.stop(grace=1)


class ProcessMesh:
    """Draft, target and every router as `specmesh serve` processes of their own, as deployed
    (services/builders.py); only the clients run in this process."""

    def __init__(self, model: str, head: Path, log_dir: Path) -> None:
        self.env = {**os.environ, "SPECMESH_TOKENS": f"{TOKEN_A}=bench", "SPECMESH_METRICS_PORT": "0",
                    "SPECMESH_MODEL": model, "SPECMESH_EAGLE_HEAD": str(head), "SPECMESH_DTYPE": "bfloat16"}
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def _serve(self, name: str, args: list[str], env: dict | None = None) -> int:
        port = _free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "--dev", *args, "--port", str(port)],
            cwd=ROOT, env={**self.env, **(env or {})}, stdout=open(self.log_dir / f"{name}.log", "w"),
            stderr=subprocess.STDOUT))
        return port

    async def start(self) -> None:
        draft = self._serve("draft", ["draft"])
        self.target = self._serve("target", ["target", "--draft-address", f"127.0.0.1:{draft}"])

    async def router(self, method: str, depth: int, nodes: int, policy: str = "fixed") -> str:
        port = self._serve(f"router-{method}-{depth}-{nodes}-{policy}", ["router"], {
            "SPECMESH_TARGET_ADDRESS": f"127.0.0.1:{self.target}", "SPECMESH_SPECULATION_METHOD": method,
            "SPECMESH_SPECULATION_DEPTH": str(depth), "SPECMESH_SPECULATION_NODES": str(nodes),
            "SPECMESH_SPECULATION_POLICY": policy})
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while True:  # the first router also waits for the target to load
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a specmesh service exited; see {self.log_dir}")
            try:
                async with AsyncClient(address, retry=NO_RETRIES) as client:
                    await collect(client, chat("Hello!", 2, 0.0, 0), AUTH_A)
                return address
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(2)

    def pids(self) -> list[int]:
        return [os.getpid(), *(p.pid for p in self.procs)]

    async def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run(mesh, tokens: int, temperatures: list[float], concurrency: int, plans: list[str],
              rounds: int) -> tuple[list[Row], list[Row]]:
    await mesh.start()
    single, batch = [], []
    try:
        async with contextlib.AsyncExitStack() as stack:
            clients = {}
            for label in plans:
                method, depth, nodes = PLANS[label]
                address = await mesh.router(method, depth, nodes)
                clients[label] = await stack.enter_async_context(AsyncClient(address, retry=NO_RETRIES))
                await collect(clients[label], chat("Hello!", 4, 0.0, 0), AUTH_A)  # connects the draft stream
            # Every prompt with every plan in turn (the order rotated per prompt): the machine's
            # drift over the run reaches every plan alike.
            work = [(t, i) for t in temperatures for i in range(len(PROMPTS))]
            for n, (temperature, i) in enumerate(tqdm(work, desc="single stream")):
                for label in plans[n % len(plans):] + plans[:n % len(plans)]:
                    start = time.perf_counter()
                    ids, _, last = await collect(clients[label], chat(PROMPTS[i], tokens, temperature, i), AUTH_A)
                    single.append(_row(label, temperature, ids, time.perf_counter() - start, last))
        arms = {"off": ("off", "fixed"), "eagle adaptive": ("eagle", "adaptive")}
        addresses = {label: await mesh.router(method, 4, 0, policy) for label, (method, policy) in arms.items()}
        async with contextlib.AsyncExitStack() as stack:
            clients = {label: await stack.enter_async_context(AsyncClient(address, retry=NO_RETRIES))
                       for label, address in addresses.items()}
            for client in clients.values():
                await collect(client, chat("Hello!", 4, 0.0, 0), AUTH_A)  # connects the draft stream
            await _concurrent_rounds(clients, list(arms), batch, tokens, temperatures, concurrency, rounds)
    finally:
        await mesh.stop()
    return single, batch


async def _concurrent_rounds(clients: dict, arms: list[str], batch: list[Row], tokens: int,
                             temperatures: list[float], concurrency: int, rounds: int) -> None:
    """`concurrency` requests at once per arm and temperature, `rounds` times (rows into `batch`)."""
    for round_index in tqdm(range(rounds), desc=f"{concurrency} concurrent"):
        # The arms take turns, in an order rotated each round, so neither always runs on a
        # warmer (or more disturbed) machine; the rounds' spread is the noise floor.
        order = arms[round_index % len(arms):] + arms[:round_index % len(arms)]
        for label in order:
            for temperature in temperatures:
                reqs = [chat(PROMPTS[i % len(PROMPTS)], tokens, temperature, i) for i in range(concurrency)]
                start = time.perf_counter()
                results = await asyncio.gather(*(collect(clients[label], r, AUTH_A) for r in reqs))
                seconds = time.perf_counter() - start
                batch.append(Row(label, temperature, sum(len(ids) for ids, _, _ in results), seconds,
                                 sum(last.usage.verify_passes for _, _, last in results),
                                 sum(last.usage.accepted_tokens for _, _, last in results), round=round_index))


def head_cost(model_dir: Path, head: Path, depth: int = 4, context: int = 128, repeats: int = 20) -> float:
    """Seconds per draft token of the head (bf16, one sequence, a chain of `depth` after
    `context` fed positions), as the draft service runs it."""
    from services.draft.eagle.drafter import HeadContext
    from services.draft.eagle.proposer import EagleProposer
    from services.draft.proposers.base import DraftSampling
    proposer = EagleProposer.load(head, model_dir, torch.bfloat16)
    drafter = proposer.drafter
    ctx = HeadContext()
    hidden = drafter.head.config.hidden_size
    feats = drafter.parts.final_norm(torch.randn(context, hidden, generator=torch.Generator().manual_seed(0)))
    drafter.feed(ctx, list(range(100, 100 + context)), feats.to(torch.bfloat16))
    drafter.chain(ctx, "s", depth, DraftSampling(), None, 16)  # warm
    start = time.perf_counter()
    for _ in range(repeats):
        drafter.feed(ctx, [7], feats[:1].to(torch.bfloat16))  # one new committed token per step
        drafter.chain(ctx, "s", depth, DraftSampling(), None, 16)
    return (time.perf_counter() - start) / (repeats * depth)


def report(single: list[Row], batch: list[Row], foreign: dict, per_draft_token: float, tokens: int) -> None:
    print(f"foreign CPU (other processes) during the run: {foreign}")
    for temperature in sorted({r.temperature for r in single}):
        rows = [r for r in single if r.temperature == temperature]
        off = _rate([r for r in rows if r.plan == "off"])
        lookup = [r for r in rows if r.plan == "prompt lookup d4"]
        print(f"\nsingle stream, {'greedy' if temperature == 0 else f'T={temperature}'}, "
              f"{len(PROMPTS)} prompts x {tokens} tokens")
        print(f"{'plan':<20} {'tok/s':>7} {'vs off':>7} {'vs lookup':>9} {'tau':>5} {'acc/pass':>8}")
        for plan in dict.fromkeys(r.plan for r in rows):
            mine = [r for r in rows if r.plan == plan]
            rate = _rate(mine)
            passes = sum(r.passes for r in mine)
            accepted = sum(r.accepted for r in mine)
            tau = f"{1 + accepted / passes:.2f}" if passes else "-"
            per = f"{accepted / passes:.2f}" if passes else "-"
            vs_lookup = f"{rate / _rate(lookup):.2f}x" if lookup else "-"
            print(f"{plan:<20} {rate:>7.1f} {rate / off:>6.2f}x {vs_lookup:>9} {tau:>5} {per:>8}")
    for temperature in sorted({r.temperature for r in batch}):
        rows = [r for r in batch if r.temperature == temperature]  # in round order
        by_plan = {plan: [r for r in rows if r.plan == plan] for plan in dict.fromkeys(r.plan for r in rows)}
        rates = {plan: [r.tokens / r.seconds for r in mine] for plan, mine in by_plan.items()}
        print(f"\nconcurrent requests, {'greedy' if temperature == 0 else f'T={temperature}'}, {len(rates['off'])} rounds "
              f"(median tok/s; per round, the arm against off in the same round):")
        for plan, mine in rates.items():
            ratios = [a / o for a, o in zip(mine, rates["off"])]
            passes, accepted, tokens = (sum(getattr(r, f) for r in by_plan[plan]) for f in ("passes", "accepted", "tokens"))
            drafted = (f"   verify passes: {passes} for {tokens} tokens, {accepted / passes:.2f} accepted per pass"
                      if passes else "")  # how much the adaptive policy let the head draft
            print(f"  {plan:<18} {statistics.median(mine):>7.1f} tok/s  {statistics.median(mine) / statistics.median(rates['off']):.2f}x off"
                  f"   per round: {' '.join(f'{x:.2f}x' for x in ratios)}{drafted}")
    off_single = _rate([r for r in single if r.plan == "off" and r.temperature == 0])
    if not off_single:
        return
    print(f"\nhead cost per draft token: {1000 * per_draft_token:.2f} ms = "
          f"{per_draft_token * off_single:.2f} target decode steps (greedy single-stream off: "
          f"{1000 / off_single:.1f} ms per token)")


def _rate(rows: list[Row]) -> float:
    return sum(r.tokens for r in rows) / max(sum(r.seconds for r in rows), 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--head", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--plans", nargs="*", default=list(DEFAULT_PLANS), choices=list(PLANS),
                        help="single-stream plans (none: only the concurrent part)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the concurrent part (arms take turns)")
    parser.add_argument("--processes", action="store_true",
                        help="each service a process of its own, as deployed (default: all in this process)")
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model, Path(read_settings().model_cache).expanduser())
    mesh = ProcessMesh(args.model, args.head.resolve(), ROOT / "benchmarks" / "results" / "logs" / "eagle_open_text") \
        if args.processes else InProcessMesh(model_dir, args.head)
    with ForeignCpu(mesh.pids) as cpu:
        single, batch = asyncio.run(run(mesh, args.tokens, args.temperatures, args.concurrency, args.plans,
                                        args.rounds))
        cost = head_cost(model_dir, args.head)
    print(f"model={args.model} bf16, threads={torch.get_num_threads()}, concurrency={args.concurrency}, "
          f"services {'in processes of their own' if args.processes else 'in one process'}")
    report(single, batch, cpu.share(), cost, args.tokens)


if __name__ == "__main__":
    main()
