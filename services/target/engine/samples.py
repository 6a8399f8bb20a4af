"""n samples of one prompt (SamplingParams.n): one request, n sequences, one prefill.

Terms:
- The *leader* is sample 0: it is queued, admitted and prefilled like any request.
- Its *followers* (samples 1 .. n-1) wait on it, outside the scheduler's queues. The step
  that computes the leader's last prompt token samples every follower's first token from
  the same logits row, each with its own generator; the scheduler then forks the leader's
  blocks to each follower (block_manager.fork: shared by reference count, the partial last
  block copied on first write) and runs it as a sequence of its own — own stop state, own
  speculation, own preemption.
- The *group* is the request: it stamps each sample's outputs with its index, sends each
  sample's finish as it happens, and gives the last one the request's usage (prompt tokens
  once, completion tokens and speculation counters summed).

With a seed, sample i's generator is seeded with seed + i: sample i of a request equals a
one-sample request with that seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.target.engine.sequence import SpeculationStats, StepOutput
from services.target.speculation.confidence import Confidence


def sample_seed(seed: int | None, index: int) -> int | None:
    """The derived seed of sample `index` (None: each sample draws its own)."""
    return None if seed is None else seed + index


def sample_id(request_id: str, index: int) -> str:
    """Sequence id of a sample; sample 0 keeps the request id."""
    return request_id if index == 0 else f"{request_id}#{index}"


@dataclass
class SampleGroup:
    """The request of n > 1 samples: fans their outputs into the request's one stream."""

    request_id: str
    n: int
    emit: Callable[[StepOutput], None]  # the request's stream
    unfinished: set[int] = field(default_factory=set)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    host_cached_prompt_tokens: int = 0
    shared_cached_prompt_tokens: int = 0
    spec: SpeculationStats | None = None
    confidence: Confidence | None = None

    def __post_init__(self) -> None:
        self.unfinished = set(range(self.n))

    @property
    def done(self) -> bool:
        return not self.unfinished

    def emitter(self, index: int) -> Callable[[StepOutput], None]:
        """The `emit` of sample `index`'s sequence."""
        return lambda out: self._forward(index, out)

    def _forward(self, index: int, out: StepOutput) -> None:
        out.index = index
        if out.finish_reason is None or out.error is not None:
            self.emit(out)  # tokens, or an error (the request fails; the engine ends the rest)
            return
        self.unfinished.discard(index)
        self.completion_tokens += out.completion_tokens
        if index == 0:  # the prompt was the leader's to compute
            self.prompt_tokens, self.cached_prompt_tokens = out.prompt_tokens, out.cached_prompt_tokens
            self.host_cached_prompt_tokens = out.host_cached_prompt_tokens
            self.shared_cached_prompt_tokens = out.shared_cached_prompt_tokens
        if out.speculation is not None:
            self.spec = _add_spec(self.spec or SpeculationStats(), out.speculation)
        if out.confidence is not None:
            self.confidence = _add_confidence(self.confidence or Confidence(), out.confidence)
        if not self.done:
            self.emit(StepOutput([], "", finish_reason=out.finish_reason, index=index, ends_request=False))
            return
        self.emit(StepOutput([], "", finish_reason=out.finish_reason, index=index,
                             prompt_tokens=self.prompt_tokens, cached_prompt_tokens=self.cached_prompt_tokens,
                             host_cached_prompt_tokens=self.host_cached_prompt_tokens,
                             shared_cached_prompt_tokens=self.shared_cached_prompt_tokens,
                             completion_tokens=self.completion_tokens, speculation=self.spec,
                             confidence=self.confidence))


def _add_spec(total: SpeculationStats, one: SpeculationStats) -> SpeculationStats:
    total.proposed += one.proposed
    total.accepted += one.accepted
    total.verify_passes += one.verify_passes
    total.fallback_steps += one.fallback_steps
    return total


def _add_confidence(total: Confidence, one: Confidence) -> Confidence:
    if one.count:
        total.min_logprob = one.min_logprob if total.count == 0 else min(total.min_logprob, one.min_logprob)
        total.count += one.count
        total.sum_logprob += one.sum_logprob
        total.sum_margin += one.sum_margin
    return total
