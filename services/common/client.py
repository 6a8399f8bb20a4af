"""The CLI's side of the router: `specmesh generate` on the shipped client (specmesh.client);
`specmesh bench` and `specmesh status` make theirs (one attempt each) with `router_ca`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc

from specmesh.client import AsyncClient

_HINTS = {
    grpc.StatusCode.UNAVAILABLE: "no router answered at {address}: start one with `specmesh up`, "
                                 "or pass --address HOST:PORT",
    grpc.StatusCode.UNAUTHENTICATED: "pass a token the router knows with --token or SPECMESH_TOKEN "
                                     "(the router's tokens come from SPECMESH_TOKENS)",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the server is at its admission limit; retry in a moment",
}


def router_ca(settings) -> bytes | None:
    """The CA that verifies the router's public TLS (`settings.router_ca`); None = plaintext."""
    return Path(settings.router_ca).expanduser().read_bytes() if settings.router_ca else None


_NO_CHAT_TEMPLATE = "has no chat template"  # services/target/server/chat.py ChatTemplateError


async def stream_generate(settings, args) -> int:
    """`specmesh generate`: streams one answer through the shipped client (its retries and
    deadline), then prints the time to first token and the decode rate."""
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, stop=args.stop, seed=args.seed)
    messages = None
    if not getattr(args, "raw", False):  # one user turn; the target applies the model's chat template
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
    ca = router_ca(settings)
    start = time.perf_counter()
    first = None
    tokens = 0
    usage = None
    async with AsyncClient(settings.router_address, settings.token, ca_pem=ca) as client:
        while True:
            stream = client.chat(messages, **sampling) if messages is not None else \
                client.generate(args.prompt, **sampling)
            try:
                async for chunk in stream:
                    if chunk.token_ids and first is None:
                        first = time.perf_counter()
                    tokens += len(chunk.token_ids)
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    usage = chunk.usage or usage
                break
            except grpc.aio.AioRpcError as exc:
                if messages is not None and _NO_CHAT_TEMPLATE in (exc.details() or ""):
                    # A base model without a chat template: ask again with the plain prompt.
                    print("specmesh: the model has no chat template (a base model): sending the "
                          "question as a plain prompt (--raw)", file=sys.stderr)
                    messages = None
                    continue
                print(f"\nspecmesh: {exc.code().name}: {exc.details()}", file=sys.stderr)
                hint = _HINTS.get(exc.code())
                if hint:
                    print(f"specmesh: {hint.format(address=settings.router_address)}", file=sys.stderr)
                return 1
    end = time.perf_counter()
    sys.stdout.write("\n")
    ttft = (first - start) if first else float("nan")
    decode_rate = (tokens - 1) / (end - first) if first and tokens > 1 and end > first else 0.0
    cached = usage.cached_prompt_tokens if usage else 0
    print(f"[specmesh] {tokens} tokens, time to first token {ttft * 1000:.0f} ms, "
          f"{decode_rate:.1f} tokens/s after the first, cached prompt tokens {cached}",
          file=sys.stderr)
    return 0
