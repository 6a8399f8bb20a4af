"""gRPC DraftService: batched draft proposals for the target's scheduler steps.

Every Propose request (unary or one message of ProposeStream) is handled in phases:
1. validate the whole request: for unary Propose nothing changes when any sequence is bad;
   on ProposeStream a bad sequence is left out (no tree for it: its own error, logged) and
   the others go on, so one bad sequence never costs the batch its drafts,
2. commit: append new committed tokens to the store and let the proposer observe them,
3. propose: one draft tree per sequence; each method's proposer is called once per
   request with all its sequences (a model's proposer drafts them in one batched forward
   per depth).

Methods: PROMPT_LOOKUP (also for UNSPECIFIED) and SUFFIX always; DRAFT_MODEL and
DYNAMIC_TREE when a draft model is configured (`DraftConfig.draft_model_dir`), EAGLE when a
feature head is (`DraftConfig.eagle_head_path`, services/draft/eagle), else they answer
FAILED_PRECONDITION. EAGLE sequences carry the target's features (checked in phase 1,
handed to the proposer in phase 2).

Concurrency: a request claims its sequence ids (`SequenceClaims`) and waits only for requests
holding one of them (the same target's late step, a Release), never for other targets.
Phases 1, 2 and the proposals without a model run on the event loop with no await in between;
proposals with a model (`_MODEL_METHODS`) run in a worker thread, so the event loop keeps
answering other targets, lookups and health checks meanwhile, and two targets' model
forwards overlap. Those threads touch only their own sequences' state (the model weights
are read only); a proposal in a thread always finishes (even when its RPC is cancelled)
before its claims are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from services.common.errors import guard_malformed
from specmesh.proto.v1 import (
    common_pb2,
    draft_service_pb2,
    draft_service_pb2_grpc,
)
from services.draft.claims import SequenceClaims
from services.draft.config import DraftConfig
from services.draft.proposers import (
    DraftSampling,
    DraftTree,
    PromptLookupProposer,
    Proposer,
    SuffixProposer,
)
from services.draft.state import DraftStateStore
from services.draft.open_sequences import observe_open_sequences
from services.draft.telemetry import DraftTelemetry

log = logging.getLogger(__name__)
SERVICE_NAME = draft_service_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
_MAX_REPORTED_PROBLEMS = 5
_MODEL_METHODS = (common_pb2.SPECULATION_METHOD_DRAFT_MODEL, common_pb2.SPECULATION_METHOD_DYNAMIC_TREE,
                  common_pb2.SPECULATION_METHOD_EAGLE)
_EAGLE = common_pb2.SPECULATION_METHOD_EAGLE
_NO_HEAD = ("needs a feature head and this draft server has none; train one with `specmesh draft train` and "
            "start the draft with --eagle-head <file>, or use another method")
_NO_DRAFT_MODEL = ("needs a draft model and this draft server has none; start it with "
                   "DraftConfig(draft_model_dir=<local Hugging Face causal LM directory that shares the "
                   "target's tokenizer>) or use SPECULATION_METHOD_PROMPT_LOOKUP or SPECULATION_METHOD_SUFFIX")


class RequestError(Exception):
    """A request the service refuses; nothing was changed."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _Plan:
    """One validated sequence of a request."""

    sequence_id: str
    new_token_ids: Sequence[int]
    method: int
    max_depth: int
    max_nodes: int
    tenant_salt: str
    sampling: DraftSampling
    features: object = None  # FeatureRows (EAGLE), checked; None = none this step


@dataclass
class Prepared:
    """A request after phases 1 and 2: its plans and the trees proposed so far (None: the
    plan's method has a model and drafts in `draft_with_models`)."""

    request: draft_service_pb2.ProposeRequest
    plans: list[_Plan]
    trees: list[DraftTree | None]
    start: float  # time.monotonic() when it was taken up

    @property
    def needs_models(self) -> bool:
        return any(tree is None for tree in self.trees)


class DraftService(draft_service_pb2_grpc.DraftServiceServicer):
    def __init__(self, config: DraftConfig, draft_model=None, eagle=None) -> None:
        """`draft_model`: an already loaded `DraftModel` to use instead of loading
        `config.draft_model_dir` (e.g. shared within one process); `eagle`: an already loaded
        `EagleProposer` instead of loading `config.eagle_head_path`."""
        self.config = config
        self.store = DraftStateStore()
        self.proposers: dict[int, Proposer] = {
            common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP: PromptLookupProposer(
                config.prompt_lookup_max_ngram, config.prompt_lookup_min_ngram),
            common_pb2.SPECULATION_METHOD_SUFFIX: SuffixProposer(
                config.suffix_max_match, config.suffix_tenant_max_tokens, config.suffix_max_tenants,
                config.suffix_max_occurrences),
        }
        if draft_model is None and config.draft_model_dir is not None:
            from services.draft.proposers.draft_model import DraftModel
            draft_model = DraftModel.load(config.draft_model_dir, config.draft_model_dtype,
                                          config.draft_model_device, config.draft_model_prefill_chunk)
        if draft_model is not None:
            from services.draft.proposers.draft_model import DraftModelProposer
            from services.draft.proposers.dynamic_tree import DynamicTreeProposer
            self.proposers[common_pb2.SPECULATION_METHOD_DRAFT_MODEL] = DraftModelProposer(draft_model)
            self.proposers[common_pb2.SPECULATION_METHOD_DYNAMIC_TREE] = DynamicTreeProposer(
                draft_model, config.dynamic_tree_top_k)
        if eagle is None and config.eagle_head_path is not None:
            eagle = _load_eagle(config)
        if eagle is not None:
            self.proposers[_EAGLE] = eagle
        self._draining = False
        self._claims = SequenceClaims()
        self.telemetry = DraftTelemetry()
        observe_open_sequences(self.store)

    async def Propose(self, request, context: grpc.aio.ServicerContext):
        return await self._answer(request, context)

    async def ProposeStream(self, request_iterator, context: grpc.aio.ServicerContext):
        async for request in request_iterator:  # ProposeStreamRequest: ProposeRequest's fields
            answer = await self._answer(request, context, per_sequence=True)
            yield draft_service_pb2.ProposeStreamResponse(trees=answer.trees, step=answer.step)

    async def Release(self, request, context: grpc.aio.ServicerContext):
        async with self._claims.hold(request.sequence_ids):
            released, unknown = self.release(request.sequence_ids)
        return draft_service_pb2.ReleaseResponse(released=released, unknown=unknown)

    async def drain(self) -> None:
        """Refuses new proposals (UNAVAILABLE: the target decodes without a draft).
        Proposals run without awaiting, so none is ever half done."""
        self._draining = True

    def propose(self, request: draft_service_pb2.ProposeRequest,
                per_sequence: bool = False) -> draft_service_pb2.ProposeResponse:
        """Validates, commits and proposes in the calling thread; raises RequestError (changing
        nothing) on bad input.

        `per_sequence` (ProposeStream): a bad sequence gets no tree (absent from the answer, so
        the target knows the draft holds nothing new of it) and the others get theirs."""
        prepared = self.prepare(request, per_sequence)
        self.draft_with_models(prepared)
        return self.answer(prepared)

    def prepare(self, request: draft_service_pb2.ProposeRequest, per_sequence: bool = False) -> Prepared:
        """Phases 1 and 2, and the proposals of methods without a model (cheap, and their
        state, e.g. a tenant's suffix tree, is shared between sequences: event loop only)."""
        start = time.monotonic()
        self.expire()
        plans = self._validate(request, per_sequence)
        for plan in plans:
            if plan.new_token_ids:
                self.store.append(plan.sequence_id, plan.new_token_ids, plan.tenant_salt, plan.method)
                self.proposers[plan.method].observe(plan.sequence_id, plan.new_token_ids)
            if plan.features is not None and plan.features.num_rows:
                from services.common.feature_rows import decode
                self.proposers[plan.method].add_features(plan.sequence_id, plan.features.start,
                                                         decode(plan.features))
            self.proposers[plan.method].set_sampling(plan.sequence_id, plan.sampling)
        prepared = Prepared(request, plans, [None] * len(plans), start)
        self._propose(prepared, lambda method: method not in _MODEL_METHODS)
        return prepared

    def draft_with_models(self, prepared: Prepared) -> None:
        """The proposals of methods with a model: one batched call per method. Touches only the
        request's own (claimed) sequences, so it may run in a worker thread."""
        self._propose(prepared, lambda method: method in _MODEL_METHODS)

    def answer(self, prepared: Prepared) -> draft_service_pb2.ProposeResponse:
        plans, trees = prepared.plans, prepared.trees
        self.telemetry.proposed(_planned_messages(prepared.request, plans),
                                [_method_label(p.method) for p in plans], trees,
                                time.monotonic() - prepared.start)
        return draft_service_pb2.ProposeResponse(trees=[tree.to_proto() for tree in trees],
                                                 step=prepared.request.step)

    def release(self, sequence_ids: Sequence[str]) -> tuple[int, int]:
        """Drops the sequences' state everywhere. Returns (released, unknown)."""
        for sequence_id in sequence_ids:
            state = self.store.get(sequence_id)
            if state is not None:
                self.proposers[state.method].release(sequence_id)
        self.telemetry.released(sequence_ids)
        return self.store.release(sequence_ids)

    def expire(self) -> int:
        """Releases sequences idle for longer than `sequence_ttl_s` (none a request in flight
        holds); returns how many."""
        idle = [i for i in self.store.idle(self.config.sequence_ttl_s) if not self._claims.holds(i)]
        if idle:
            log.info("releasing %d draft sequences idle for over %.0f s", len(idle), self.config.sequence_ttl_s)
            self.release(idle)
        return len(idle)

    # ---- helpers ------------------------------------------------------------------------

    async def _answer(self, request, context: grpc.aio.ServicerContext, per_sequence: bool = False):
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "draft server is shutting down; decode without a draft")
        try:
            async with self._claims.hold(seq.sequence_id for seq in request.sequences):
                prepared = self.prepare(request, per_sequence)
                if prepared.needs_models:
                    work = asyncio.ensure_future(asyncio.to_thread(self.draft_with_models, prepared))
                    try:
                        await asyncio.shield(work)
                    except asyncio.CancelledError:
                        await asyncio.wait([work])  # keep the claims until the proposal is done
                        raise
                return self.answer(prepared)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
        except Exception:  # a bug: answer INTERNAL, never UNKNOWN
            log.exception("draft proposal failed")
            await context.abort(grpc.StatusCode.INTERNAL, "draft proposal failed; decode without a draft")

    def _validate(self, request: draft_service_pb2.ProposeRequest, per_sequence: bool = False) -> list[_Plan]:
        """The request's plans. Unary Propose (`per_sequence` False): any bad sequence refuses the
        whole request (RequestError, nothing changed). ProposeStream: a bad sequence is left out
        (its own error, logged; no tree for it this step) and the others are planned."""
        if not request.sequences:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "no sequences in the request")
        problems: list[str] = []
        denied: list[str] = []
        missing: list[str] = []
        plans: list[_Plan] = []
        seen: set[str] = set()
        for i, seq in enumerate(request.sequences):
            where = f"sequences[{i}] (id {seq.sequence_id!r})"
            duplicate = seq.sequence_id in seen
            if duplicate:
                problems.append(f"{where}: duplicate sequence_id in one request")
            seen.add(seq.sequence_id)
            plan, seq_problems, seq_denied, seq_missing = self._validate_sequence(seq, where)
            problems += seq_problems
            denied += seq_denied
            missing += seq_missing
            if plan is not None and not duplicate:
                plans.append(plan)
        refusals = [(grpc.StatusCode.INVALID_ARGUMENT, problems), (grpc.StatusCode.PERMISSION_DENIED, denied),
                    (grpc.StatusCode.FAILED_PRECONDITION, missing)]
        for code, messages in refusals:
            if messages and not per_sequence:
                raise RequestError(code, _summary(messages))
            if messages:
                log.warning("draft stream step %d: %s: %s (no drafts for them this step)",
                            request.step, code.name, _summary(messages))
        room = self.config.max_sequences - len(self.store)
        new = [plan for plan in plans if plan.sequence_id not in self.store]
        if len(new) > room:
            if not per_sequence:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{len(new)} new sequences would exceed the limit of {self.config.max_sequences} "
                                   "open sequences; release finished sequences or retry later")
            refused = {plan.sequence_id for plan in new[max(room, 0):]}
            log.warning("draft stream step %d: %d new sequences refused: the limit of %d open sequences "
                        "is reached", request.step, len(refused), self.config.max_sequences)
            plans = [plan for plan in plans if plan.sequence_id not in refused]
        return plans

    def _validate_sequence(self, seq: draft_service_pb2.DraftSequence,
                           where: str) -> tuple[_Plan | None, list[str], list[str], list[str]]:
        """Returns (plan or None, invalid-argument problems, permission problems,
        failed preconditions)."""
        cfg = self.config
        problems: list[str] = []
        missing: list[str] = []
        if not seq.sequence_id:
            problems.append(f"{where}: sequence_id is empty")
        method = seq.method or common_pb2.SPECULATION_METHOD_PROMPT_LOOKUP
        proposer = self.proposers.get(method)
        if method in _MODEL_METHODS and proposer is None:
            missing.append(f"{where}: method {_method_name(method)} {_NO_HEAD if method == _EAGLE else _NO_DRAFT_MODEL}")
        elif proposer is None:
            problems.append(f"{where}: method {_method_name(seq.method)} not supported by this draft server")
        if not 1 <= seq.max_depth <= cfg.max_depth_limit:
            problems.append(f"{where}: max_depth {seq.max_depth} is out of range [1, {cfg.max_depth_limit}]")
        if not 0 <= seq.max_nodes <= cfg.max_nodes_limit:
            problems.append(f"{where}: max_nodes {seq.max_nodes} is out of range [0, {cfg.max_nodes_limit}] "
                            "(0 = one chain of max_depth nodes)")
        if not (math.isfinite(seq.temperature) and seq.temperature >= 0.0):
            problems.append(f"{where}: temperature {seq.temperature} must be finite and >= 0")
        if seq.top_k < 0 or not 0.0 <= seq.top_p <= 1.0:
            problems.append(f"{where}: top_k {seq.top_k} must be >= 0 and top_p {seq.top_p} in [0, 1]")
        new_token_ids = seq.new_token_ids
        if new_token_ids and min(new_token_ids) < 0:
            problems.append(f"{where}: new_token_ids contains negative token ids")
        vocab_size = None if proposer is None else proposer.vocab_size
        if new_token_ids and vocab_size is not None and max(new_token_ids) >= vocab_size:
            problems.append(f"{where}: new_token_ids contains token id {max(new_token_ids)}, outside the "
                            f"draft model's vocabulary of {vocab_size} tokens")
        state = self.store.get(seq.sequence_id)
        if state is None and not new_token_ids:
            problems.append(f"{where}: unknown sequence (new or released) needs its prompt in new_token_ids")
        num_tokens = len(new_token_ids) + (0 if state is None else state.num_tokens)
        if num_tokens > cfg.max_history_tokens:
            problems.append(f"{where}: history of {num_tokens} tokens is above the limit of "
                            f"{cfg.max_history_tokens}")
        features = seq.features if seq.HasField("features") and method == _EAGLE else None
        if features is not None and proposer is not None:
            from services.common.feature_rows import problem
            trouble = problem(features, proposer.hidden_size, num_tokens)
            if trouble:
                problems.append(f"{where}: {trouble}")
        denied: list[str] = []
        if state is not None and not problems:
            if state.tenant_salt != seq.tenant_salt:
                denied.append(f"{where}: sequence belongs to another tenant")
            elif state.method != method:
                problems.append(f"{where}: sequence was opened with method {_method_name(state.method)}, "
                                f"got {_method_name(method)}; release it first")
        if problems or denied or missing:
            return None, problems, denied, missing
        max_nodes = seq.max_nodes or seq.max_depth
        sampling = DraftSampling(seq.temperature, seq.top_k, seq.top_p,
                                 seq.seed if seq.has_seed else None)
        return _Plan(seq.sequence_id, new_token_ids, method, seq.max_depth, max_nodes, seq.tenant_salt,
                     sampling, features), [], [], []

    def _propose(self, prepared: Prepared, chosen) -> None:
        """Fills `prepared.trees` of the plans whose method is `chosen`; each method's proposer is
        called once."""
        groups: dict[int, list[int]] = {}
        for i, plan in enumerate(prepared.plans):
            if chosen(plan.method):
                groups.setdefault(plan.method, []).append(i)
        plans = prepared.plans
        for method, indices in groups.items():
            states = [self.store.get(plans[i].sequence_id) for i in indices]
            proposed = self.proposers[method].propose_batch(
                states, [plans[i].max_depth for i in indices], [plans[i].max_nodes for i in indices])
            for i, tree in zip(indices, proposed, strict=True):
                prepared.trees[i] = tree


def _planned_messages(request, plans: list[_Plan]) -> list:
    """The DraftSequence message of each plan, in the plans' order (the request's)."""
    first = {}
    for seq in request.sequences:
        first.setdefault(seq.sequence_id, seq)
    return [first[plan.sequence_id] for plan in plans]


def _method_name(method: int) -> str:
    try:
        return common_pb2.SpeculationMethod.Name(method)
    except ValueError:
        return str(method)


def _method_label(method: int) -> str:
    """'prompt_lookup' for SPECULATION_METHOD_PROMPT_LOOKUP (the metric attribute value)."""
    return _method_name(method).removeprefix("SPECULATION_METHOD_").lower()


def _summary(problems: list[str]) -> str:
    more = len(problems) - _MAX_REPORTED_PROBLEMS
    text = "; ".join(problems[:_MAX_REPORTED_PROBLEMS])
    return text + (f"; and {more} more" if more > 0 else "")


def add_to_server(server: grpc.aio.Server, service: DraftService) -> None:
    draft_service_pb2_grpc.add_DraftServiceServicer_to_server(service, guard_malformed(server))


def _load_eagle(config: DraftConfig):
    """The feature head of `config`; None (with a warning) for a head the mesh chose by itself
    (`eagle_optional`) that was trained for another model."""
    from services.draft.eagle.checkpoint import HeadMismatch
    from services.draft.eagle.proposer import EagleProposer
    from services.draft.proposers.draft_model import DTYPES
    try:
        return EagleProposer.load(config.eagle_head_path, config.eagle_target_dir, DTYPES[config.draft_model_dtype],
                                  config.draft_model_device, config.dynamic_tree_top_k)
    except HeadMismatch as e:
        if not config.eagle_optional:
            raise
        log.warning("eagle off: the shipped feature head does not fit this target (%s)", e)
        return None
