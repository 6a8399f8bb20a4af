"""The router's checks of a GenerateRequest, before any work is done for it.

Every problem becomes one BadRequest field violation; `validate` raises a `Refusal`
(INVALID_ARGUMENT, reason INVALID_REQUEST or REQUEST_TOO_LARGE) listing all of them.
Unknown `model` pools are the routing's to refuse (services/router/routing.py).
"""

from __future__ import annotations

import grpc

from services.common.errors import Refusal, Violation
from services.common.limits import RequestLimits
from specmesh.proto.v1 import router_service_pb2
from services.common.sample_count import sample_count_violations
from services.common.sampling_params import SamplingConfig, params_violations, sampling_from_proto
from services.common.constraints import constraint_from_proto, constraint_violations
from services.target.server.chat import tool_texts


def validate(request: router_service_pb2.GenerateRequest, limits: RequestLimits,
             max_tokens_limit: int, max_samples: int) -> SamplingConfig:
    """The request's validated sampling config; raises Refusal listing every problem."""
    params = request.sampling
    # Sizes first: they bound the work of every later check.
    too_large = limits.violations([request.prompt, *(m.content for m in request.messages), *tool_texts(request)],
                                  params.stop, "messages" if request.messages else "prompt")
    if too_large:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, _message(too_large), "REQUEST_TOO_LARGE", too_large)
    problems = [Violation(f"sampling.{field}", message) for field, message in params_violations(params)]
    problems += [Violation(f"sampling.{field}", message)
                 for field, message in constraint_violations(constraint_from_proto(params))]
    if request.prompt and request.messages:
        problems.append(Violation("prompt", "set prompt or messages, not both"))
    elif request.messages:
        if not any(m.content.strip() for m in request.messages):
            problems.append(Violation("messages", "messages are empty"))
    elif not request.prompt.strip():
        problems.append(Violation("prompt", "prompt is empty"))
    if request.tools and not request.messages:
        problems.append(Violation("tools", "tools need messages (a chat request)"))
    if params.max_tokens > max_tokens_limit:
        problems.append(Violation("sampling.max_tokens", f"max_tokens {params.max_tokens} is above "
                                  f"the limit {max_tokens_limit}"))
    problems += [Violation(field, message) for field, message in sample_count_violations(
        params.n, params.seed if params.has_seed else None, max_samples)]
    if problems:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, _message(problems), "INVALID_REQUEST", problems)
    return sampling_from_proto(params)


def _message(violations: list[Violation]) -> str:
    return "; ".join(v.description for v in violations)
