"""The target's request path for constraints: read, check, compile (off the engine thread)."""

from __future__ import annotations

import grpc

from services.common.constraints import ConstraintSpec
from services.common.errors import Violation, abort
from services.target.structured.compiler import ConstraintCompiler, ConstraintError


async def compile_constraint(compiler: ConstraintCompiler, spec: ConstraintSpec | None, context):
    """The compiled grammar of the request's constraint (read by services/common/request_checks.py),
    None when it has none; a constraint that cannot be served aborts the call with
    INVALID_ARGUMENT naming `sampling.<field>`."""
    if spec is None:
        return None
    try:
        return await compiler.compile(spec)
    except ConstraintError as exc:
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{exc}", "INVALID_CONSTRAINT",
                    [Violation(f"sampling.{exc.field}", exc.reason)])
