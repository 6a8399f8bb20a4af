"""State of one request inside the engine (owned by the engine thread).

A `Sequence` holds what the request asked for and the state its owners write, each in
its own place:
- the request's inputs and per-request objects (sampling, generator, detokenizer, grammar
  state, logits processor), set at submit;
- the scheduling state (`num_computed`, `num_cached_prompt`, `status`, `num_preemptions`,
  `admitted`): written by the scheduler only (services/target/engine/scheduler.py), which
  also empties `followers` when they fork (services/target/engine/samples.py);
- its `timeline` (arrival, admission, first and last token): written by the metrics only
  (services/target/metrics.py);
- its speculation counters `spec` and `confidence`: written by the speculator on verify
  passes and by plain sampling (services/target/engine/plain_sampling.py).
Which committed tokens the draft service holds is not here: the draft client alone keeps
that (services/target/speculation/draft_client.py); the engine keeps its own queue
accounting (which prompts still count as queued).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.common.sampling_params import SamplingConfig
from services.target.metrics import Timeline
from services.target.speculation.confidence import Confidence
from services.target.output.detokenizer import IncrementalDetokenizer


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # end-of-sequence token
    LENGTH = "length"  # max_tokens reached
    STOP_SEQUENCE = "stop_sequence"
    ABORTED = "aborted"  # cancelled by the caller


@dataclass
class StepOutput:
    """What a request's stream receives after a step: newly committed tokens and text."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    host_cached_prompt_tokens: int = 0  # of cached_prompt_tokens, restored from the host tier
    shared_cached_prompt_tokens: int = 0  # of cached_prompt_tokens, loaded from the shared tier
    completion_tokens: int = 0
    error: Exception | None = None
    speculation: "SpeculationStats | None" = None
    confidence: "Confidence | None" = None  # set when the request asked for it
    logprobs: list | None = None  # [len(token_ids)] TokenLogprob, when the request asked for them
    index: int = 0  # the sample (0 .. n-1) these tokens belong to (services/target/engine/samples.py)
    ends_request: bool = True  # False: one sample of several finished, others go on


@dataclass(frozen=True)
class SpeculationPlan:
    """Per-request plan from the router: method (common_pb2.SpeculationMethod) and limits."""

    method: int
    max_depth: int
    max_nodes: int
    load_aware: bool = False  # the target may shorten the depth per step (speculation_cost.LoadAwareDepth)
    acceptance: float = 0.0  # the router's predicted acceptance rate α; 0 = none


@dataclass
class SpeculationStats:
    """Per-request speculation counters (the words of docs/speculation.md)."""

    proposed: int = 0  # draft tokens sent to verification
    accepted: int = 0  # draft tokens on accepted paths
    verify_passes: int = 0
    # Of proposed / accepted: the grammar's forced drafts (the text the constraint allows is
    # fixed; only its tokenisation can be refused), counted apart so the drafts of the free
    # parts are judged by their own acceptance and forced chains by theirs.
    forced_proposed: int = 0
    forced_accepted: int = 0
    fallback_steps: int = 0  # steps that decoded normally because the draft failed
    # Per verify pass, for the request's trace (services/target/metrics.py), monotonic seconds:
    # [draft_start, draft_end, verify_start, verify_end, proposed, accepted].
    passes: list = field(default_factory=list)
    draft_window: tuple[float, float] = (0.0, 0.0)  # this step's draft call (start, end)

    @property
    def rejected(self) -> int:
        return self.proposed - self.accepted

    @property
    def acceptance_length(self) -> float:
        """Accepted + bonus tokens per verify pass (0 when no pass ran)."""
        return (self.accepted + self.verify_passes) / self.verify_passes if self.verify_passes else 0.0


@dataclass
class Sequence:
    seq_id: str
    # Prompt then committed output: one list, appended per token and never rebuilt (the
    # engine reads it every step, so a prompt + output concatenation would cost O(length)).
    token_ids: list[int]
    sampling: SamplingConfig
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    emit: Callable[[StepOutput], None]  # thread-safe hand-off to the request's stream
    extra_key: str = ""  # model id + tenant salt: scopes this sequence's prefix-cache blocks
    timeline: Timeline = field(default_factory=Timeline)  # written by services/target/metrics.py
    # Scheduling state: written by the scheduler only.
    num_computed: int = 0  # tokens whose KV is in the pool
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache
    num_host_cached_prompt: int = 0  # of those, restored from the host tier
    num_shared_cached_prompt: int = 0  # of those, loaded from the shared tier (through the host tier)
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    admitted: bool = False  # left the waiting queue at least once
    plan: SpeculationPlan | None = None  # None = no speculation
    spec: SpeculationStats = field(default_factory=SpeculationStats)  # written by the speculator
    tenant_salt: str = ""  # sent to the draft service only (scopes suffix trees); never traced
    bucket: str = ""
    span_context: object = None  # the request's span context, linked from engine-step spans
    priority: int = 0  # tenant priority: higher is admitted first and preempted last
    confidence: Confidence | None = None  # log-prob sums of committed tokens, when asked for
    # Penalties, bias, min_tokens (services/target/model/logits_processors.py); None = none asked.
    logits_processor: object = None
    # n samples of one prompt (services/target/engine/samples.py): the request's group, this
    # sample's index, and (sample 0 until its prefill ends) the samples that wait to fork from it.
    group: "SampleGroup | None" = None
    index: int = 0
    followers: list["Sequence"] = field(default_factory=list)
    grammar: object = None  # services/target/structured/grammar_state.GrammarState, when constrained
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def request_id(self) -> str:
        return self.group.request_id if self.group is not None else self.seq_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
