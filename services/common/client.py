"""A small streaming client for the router (used by `specmesh generate`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc

from specmesh.proto.v1 import (
    common_pb2,
    router_service_pb2,
    router_service_pb2_grpc,
)
from services.common.tls import public_channel

_HINTS = {
    grpc.StatusCode.UNAVAILABLE: "no router answered at {address}: start one with `specmesh up`, "
                                 "or pass --address HOST:PORT",
    grpc.StatusCode.UNAUTHENTICATED: "pass a token the router knows with --token or SPECMESH_TOKEN "
                                     "(the router's tokens come from SPECMESH_TOKENS)",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the server is at its admission limit; retry in a moment",
}


def router_channel(settings) -> grpc.aio.Channel:
    """A channel to the router's public port: TLS verified with `settings.router_ca` when set."""
    ca = Path(settings.router_ca).expanduser().read_bytes() if settings.router_ca else None
    return public_channel(settings.router_address, ca)


_NO_CHAT_TEMPLATE = "has no chat template"  # services/target/server/chat.py ChatTemplateError


async def stream_generate(settings, args) -> int:
    sampling = common_pb2.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, stop=args.stop)
    if args.seed is not None:
        sampling.seed, sampling.has_seed = args.seed, True
    if getattr(args, "raw", False):
        request = router_service_pb2.GenerateRequest(prompt=args.prompt, sampling=sampling)
    else:  # one user turn; the target applies the model's chat template
        messages = [common_pb2.ChatMessage(role="system", content=args.system)] if args.system else []
        messages.append(common_pb2.ChatMessage(role="user", content=args.prompt))
        request = router_service_pb2.GenerateRequest(messages=messages, sampling=sampling)
    metadata = (("authorization", f"Bearer {settings.token}"),)
    start = time.perf_counter()
    first = None
    tokens = 0
    usage = None
    async with router_channel(settings) as channel:
        stub = router_service_pb2_grpc.RouterServiceStub(channel)
        for attempt in (1, 2):
            try:
                async for response in stub.Generate(request, metadata=metadata):
                    chunk = response.chunk
                    if chunk.token_ids and first is None:
                        first = time.perf_counter()
                    tokens += len(chunk.token_ids)
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    if chunk.HasField("usage"):
                        usage = chunk.usage
                break
            except grpc.aio.AioRpcError as exc:
                if attempt == 1 and request.messages and _NO_CHAT_TEMPLATE in (exc.details() or ""):
                    # A base model (the packaged Gemma 3 270M is one) has no chat template.
                    print("specmesh: the model has no chat template (a base model): sending the "
                          "question as a plain prompt (--raw)", file=sys.stderr)
                    request = router_service_pb2.GenerateRequest(prompt=args.prompt, sampling=sampling)
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
