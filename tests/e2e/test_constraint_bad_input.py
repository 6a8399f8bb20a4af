"""Constraints that cannot be served get INVALID_ARGUMENT naming the field and the reason,
at the router (structure, schema, keywords, size) or the target (syntax, a regex that never
matches, a compiled grammar over the size limit, a compile over the time limit), while
another tenant's stream goes on unharmed."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from services.common.errors import details_of
from specmesh.proto.v1 import common_pb2
from tests.mesh import AUTH_A, AUTH_B, collect, request, start_mesh
from tests.structured import CONSTRAINTS, valid

BIG_SCHEMA = json.dumps({"type": "object", "required": [f"k{i}" for i in range(150)],
                         "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{1,20}(x|y){3,9}"}
                                        for i in range(150)}})
BAD = {  # name: (constraint, field, words the reason must contain, refused by)
    "invalid schema": (common_pb2.Constraint(json_schema='{"type": "foo"}'), "json_schema",
                       "invalid schema", "router"),
    "schema not JSON": (common_pb2.Constraint(json_schema="{type: object"), "json_schema",
                        "not JSON", "router"),
    "unsupported keyword": (common_pb2.Constraint(json_schema='{"type": "array", "uniqueItems": true}'),
                            "json_schema", "unsupported keyword 'uniqueItems'", "router"),
    "oversized grammar text": (common_pb2.Constraint(grammar='root ::= "a"' + " " * 70000), "grammar",
                               "limit", "router"),
    "empty choice": (common_pb2.Constraint(choice=common_pb2.ChoiceList()), "choice", "at least one",
                     "router"),
    "regex that never matches": (common_pb2.Constraint(regex="[^\\x00-\\U0010FFFF]"), "regex",
                                 "never matches", "target"),
    "unsupported regex syntax": (common_pb2.Constraint(regex="(?!a)b"), "regex", "Lookahead", "target"),
    "grammar syntax error": (common_pb2.Constraint(grammar='root ::= "a" |'), "grammar", "EBNF", "target"),
    "oversized compiled grammar": (common_pb2.Constraint(json_schema=BIG_SCHEMA), "json_schema",
                                   "bytes; the limit", "target"),
}


async def _error(stub, req, metadata=AUTH_A) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, req, metadata)
    return info.value


async def test_bad_constraints_are_refused_while_another_tenant_streams_on(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, grammar_max_bytes=2 << 20)
    try:
        long = request("Once upon a time", 200)
        alone, _, _ = await collect(mesh.router_stub, long, AUTH_B)
        other = asyncio.ensure_future(collect(mesh.router_stub, long, AUTH_B))
        for name, (constraint, field, reason, where) in BAD.items():
            error = await _error(mesh.router_stub, request("hello", 16, constraint=constraint))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert reason in error.details(), (name, error.details())
            violations = details_of(error)["BadRequest"].field_violations
            assert [v.field for v in violations] == [f"sampling.constraint.{field}"], name
            if where == "router":  # never reached the target's compiler
                assert mesh.engine.grammars.compiles == 0, name
        ids, text, last = await other
        assert ids == alone  # token for token what it generates alone
        # The servers keep serving constrained requests too.
        _, text, last = await collect(mesh.router_stub, request("hi", 32, constraint=CONSTRAINTS["regex"]))
        assert valid("regex", text)
    finally:
        await mesh.stop()


async def test_a_compile_over_the_time_limit_is_refused_once_and_then_at_once(tiny_llama_dir):
    mesh = await start_mesh(tiny_llama_dir, grammar_compile_timeout_s=0.01)
    try:
        slow = request("hello", 16, constraint=common_pb2.Constraint(json_schema=BIG_SCHEMA))
        for _ in range(2):
            error = await _error(mesh.target_stub(), _target_request(slow))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "longer than 0.01 s" in error.details()
            assert [v.field for v in details_of(error)["BadRequest"].field_violations] == [
                "sampling.constraint.json_schema"]
        assert len(mesh.engine.grammars._in_flight) <= 1  # the one compile, not one per request
        _, text, _ = await collect(mesh.router_stub, request("hi", 16, constraint=CONSTRAINTS["choice"]))
        assert valid("choice", text)
    finally:
        await mesh.stop()


def _target_request(req):
    from specmesh.proto.v1 import target_service_pb2
    return target_service_pb2.TargetServiceGenerateRequest(request_id="slow", prompt=req.prompt,
                                                           sampling=req.sampling)
