"""A RouterService that answers Generate from a script, for tests of what calls the router
(specmesh.client, the gateway): per call an error (with an optional pushback hint) or a list
of texts, optionally followed by an error after streaming."""

from __future__ import annotations

import time

import grpc

from specmesh.proto.v1 import common_pb2, router_service_pb2, router_service_pb2_grpc


class Scripted(router_service_pb2_grpc.RouterServiceServicer):
    """Answers Generate from a script: per call, an error code (with optional pushback) or
    a list of texts; then an error after streaming when the script says so."""

    def __init__(self, script) -> None:
        self.script = list(script)
        self.calls: list[float] = []  # time.monotonic() of each call
        self.tokens: list[str] = []

    async def Generate(self, req, context):
        self.calls.append(time.monotonic())
        self.tokens.append(dict(context.invocation_metadata()).get("authorization", ""))
        step = self.script.pop(0)
        if isinstance(step, tuple):
            code, pushback = step
            if pushback is not None:
                context.set_trailing_metadata((("grpc-retry-pushback-ms", pushback),))
            await context.abort(code, f"scripted {code.name}")
        texts, then = (step, None) if isinstance(step, list) else (step["texts"], step.get("then"))
        for i, text in enumerate(texts):
            last = i == len(texts) - 1 and then is None
            yield router_service_pb2.GenerateResponse(chunk=common_pb2.GenerateChunk(
                text=text, token_ids=[i], finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0))
        if then is not None:
            await context.abort(then, "failed after streaming")


async def serve(script) -> tuple[grpc.aio.Server, Scripted, str]:
    service = Scripted(script)
    server = grpc.aio.server()
    router_service_pb2_grpc.add_RouterServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, service, f"127.0.0.1:{port}"
