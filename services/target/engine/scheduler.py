"""Continuous batching: which sequences run in the next step, how many tokens each, and
the bookkeeping after the step.

The engine's step is three calls: `schedule` -> the engine runs
the batch -> `postprocess`. One token budget per step (`max_batched_tokens`) covers
everything the forward pass computes: decode tokens of running sequences, their draft-tree
slots (each draft node is a row of the verify pass), and prefill chunks of new ones. Draft
slots never preempt anyone and never delay an admission: they get what the budget and the
free blocks have left after running sequences' tokens and waiting requests' prefill.
When blocks run out, the youngest running sequence
is preempted: its blocks go back and it is re-queued at the front. Its KV is swapped out to
the host tier when the block manager finds that measured cheaper than recomputing it and the
tier has room (`BlockManager.swap_out`), and swapped back in when it resumes; otherwise it
recomputes from its first token (its full blocks may still come back from the prefix cache).
Tenant priority orders both: the waiting queue is highest priority first, and the
lowest-priority (then youngest) running sequence is preempted first.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.target.engine.block_manager import BlockManager
from services.target.engine.sequence import FinishReason, SeqStatus, Sequence
from services.target.structured.hooks import commit_token


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # index of the first token computed this step
    num_tokens: int
    num_draft_slots: int = 0  # draft nodes it may verify after its one token (budget and blocks held)

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last token, so a new token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens

    @property
    def budget_tokens(self) -> int:
        """Rows this item may add to the forward pass: its tokens plus its draft slots."""
        return self.num_tokens + self.num_draft_slots


@dataclass
class StepResult:
    """What the run phase produced for one sequence."""

    tokens: list[int] = field(default_factory=list)  # new tokens (sampled, or accepted path + bonus)
    num_computed: int | None = None  # KV entries now valid (verify: context + root + accepted); None = as scheduled
    logprobs: list | None = None  # [len(tokens)] TokenLogprob, when the request asked for them


@dataclass(frozen=True)
class SeqUpdate:
    """A sequence's committed tokens after a step, for the engine to emit (and finish)."""

    seq: Sequence
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list | None = None  # of the committed tokens, when the request asked for them


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_batched_tokens: int,
                 draft_limit: Callable[[Sequence], int] | None = None, preemption_mode: str = "auto") -> None:
        """`draft_limit(seq)`: the most draft nodes `seq` could verify next step (0 = none);
        None when the engine has no draft service. `preemption_mode`: "auto" swaps a preempted
        sequence where the block manager measures that cheaper than recomputing it, "swap" always,
        "recompute" never (services/target/settings.py PreemptionMode); a swap needs room too."""
        if preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode must be auto, swap or recompute, got {preemption_mode!r}")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.draft_limit = draft_limit
        self.preemption_mode = preemption_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of those, swapped out rather than recomputed
        self.prompt_tokens_computed = 0  # prompt positions whose KV a forward pass computed
        self.arrivals = ArrivalRate()  # new requests per second (speculation weighs their TTFT)
        # (seq, the chained hashes of its cached prefix blocks) -> how many of them it may reuse;
        # None = all. The engine's speculator sets it: a feature-head sequence reuses only blocks
        # whose features it can still send (services/target/speculation/prefix_features.py).
        self.prefix_limit: Callable[[Sequence, tuple[int, ...]], int] | None = None

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.arrivals.observe(seq.timeline.arrival)
        self._enqueue(seq, front=False)

    def arrival_rate(self, now: float | None = None) -> float:
        """Requests per second arriving lately (0 when none arrived in the window)."""
        return self.arrivals.rate(time.monotonic() if now is None else now)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Waiting order: higher priority first; within a priority FIFO (preempted ones first)."""
        if not self.waiting or self.waiting[-1].priority >= seq.priority and not front:
            self.waiting.append(seq)  # the common case: one priority
            return
        for i, other in enumerate(self.waiting):
            if other.priority < seq.priority or (front and other.priority == seq.priority):
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the queues and frees its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    def seats_full(self) -> bool:
        """Every seat is taken: a new request can start only when a running one finishes."""
        return len(self.running) >= self.max_num_seqs

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        """The next step's batch; sum(item.budget_tokens) <= max_batched_tokens."""
        budget = self.max_batched_tokens
        batch: list[ScheduledSeq] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below while making room for an older one
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._reserve_or_preempt(seq, seq.num_computed + n, batch):
                continue
            batch.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        num_running = len(batch)
        while self.waiting and budget > 0 and self._has_seats(self.waiting[0]):
            seq = self.waiting[0]
            n = self._take_blocks(seq, budget)
            if n is None:
                break  # FIFO: don't let later requests overtake
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.admitted = True
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        if self.draft_limit is not None and budget > 0:
            # After admission: waiting requests' prefill comes first (their TTFT); draft slots,
            # for sequences that were already decoding, get what is left.
            slotted, budget = self._add_draft_slots(batch[:num_running], budget)
            batch = slotted + batch[num_running:]
        return batch

    def postprocess(self, batch: list[ScheduledSeq], results: dict[str, StepResult],
                    eos_token_ids: frozenset[int]) -> list[SeqUpdate]:
        """After the forward pass: advances each sequence's computed KV, frees draft slots it did
        not keep, appends its new tokens (stopping at EOS, a stop sequence or max_tokens) and
        enters its full blocks into the prefix cache. Sequences no longer running are skipped."""
        updates = []
        for item in batch:
            seq = item.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # failed or finished during the step
            result = results.get(seq.seq_id) or StepResult()
            computed = item.start + item.num_tokens
            self.prompt_tokens_computed += max(0, min(computed, seq.num_prompt_tokens) - item.start)
            seq.num_computed = computed if result.num_computed is None else result.num_computed
            if item.num_draft_slots:
                self.blocks.truncate(seq.seq_id, seq.num_computed)  # rejected and unused slots
            update = _append(seq, result.tokens, eos_token_ids) if result.tokens else None
            if update is not None and result.logprobs is not None:
                update = replace(update, logprobs=result.logprobs[:len(update.token_ids)])
            # After the append: only positions holding both KV and a committed token are hashed.
            self.blocks.commit(seq.seq_id, seq.token_ids, min(seq.num_computed, seq.num_tokens),
                               seq.extra_key)
            if update is not None:
                updates.append(update)
            if seq.followers and result.tokens:  # its prefill ended: the other samples start
                updates += self._fork_followers(seq, results, eos_token_ids)
        return updates

    def _take_blocks(self, seq: Sequence, budget: int) -> int | None:
        """Gives a waiting sequence its blocks (with its cached prefix, or its swapped-out KV back)
        and sets its computed tokens; returns how many it computes this step, None if it does not fit."""
        swapped = self.blocks.swapped_tokens(seq.seq_id)
        if swapped:
            n = min(seq.num_tokens - swapped, budget)
            if not self.blocks.can_resume(swapped + n):
                return None
            self.blocks.resume(seq.seq_id, swapped + n)
            seq.num_computed = swapped
            return n
        match = self.blocks.match_prefix(seq.token_ids, seq.extra_key)
        if self.prefix_limit is not None and match.num_tokens:
            match = match.first(self.prefix_limit(seq, match.all_hashes))
        n = min(seq.num_tokens - match.num_tokens, budget)
        if not self.blocks.can_admit(match, match.num_tokens + n):
            return None
        match = self.blocks.admit(seq.seq_id, match, match.num_tokens + n, seq.num_prompt_tokens)  # as restored
        seq.num_computed = match.num_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_prompt = min(match.num_tokens, seq.num_prompt_tokens)
            restored = min(match.num_restored_tokens, seq.num_cached_prompt)
            seq.num_shared_cached_prompt = min(match.num_shared_tokens, restored)
            seq.num_host_cached_prompt = restored - seq.num_shared_cached_prompt
        return n

    def _has_seats(self, seq: Sequence) -> bool:
        """Admission counts samples: running ones, those waiting to fork, and `seq`'s."""
        seats = len(self.running) + sum(len(s.followers) for s in self.running)
        return seats + 1 + len(seq.followers) <= self.max_num_seqs

    def _fork_followers(self, leader: Sequence, results: dict[str, StepResult],
                        eos_token_ids: frozenset[int]) -> list[SeqUpdate]:
        """Starts each follower of `leader` on its prompt blocks (shared by reference count) with
        the first token the engine sampled for it (services/target/engine/samples.py)."""
        updates = []
        for follower in leader.followers:
            if follower.status is SeqStatus.FINISHED:
                continue  # its first token failed; the engine ends the request
            self.blocks.fork(leader.seq_id, follower.seq_id, leader.num_computed)
            follower.num_computed = leader.num_computed
            follower.num_cached_prompt = leader.num_cached_prompt
            follower.status, follower.admitted = SeqStatus.RUNNING, True
            self.running.append(follower)
            result = results.get(follower.seq_id)
            if result is not None and result.tokens:
                updates.append(_append(follower, result.tokens, eos_token_ids))
        leader.followers = []
        return updates

    def _add_draft_slots(self, batch: list[ScheduledSeq], budget: int) -> tuple[list[ScheduledSeq], int]:
        """Gives decoding sequences draft slots from what the budget has left (blocks reserved too)."""
        out = []
        for item in batch:
            seq = item.seq
            decoding = item.samples and item.num_tokens == 1 and not seq.followers  # followers share its row
            slots = min(self.draft_limit(seq), budget) if decoding else 0
            end = item.start + 1 + slots
            if slots > 0 and self.blocks.can_reserve(seq.seq_id, end):
                self.blocks.reserve(seq.seq_id, end)
                item = ScheduledSeq(seq, item.start, item.num_tokens, slots)
                budget -= slots
            out.append(item)
        return out, budget

    def _reserve_or_preempt(self, seq: Sequence, num_tokens: int, batch: list[ScheduledSeq]) -> bool:
        """Reserves room for `seq`, preempting the youngest unscheduled running sequences if needed."""
        scheduled = None  # built only when room must be made (rare), not on every decode
        while not self.blocks.can_reserve(seq.seq_id, num_tokens):
            scheduled = scheduled or {id(item.seq) for item in batch}
            victim = max((s for s in self.running if id(s) not in scheduled),
                         key=lambda s: (-s.priority, s.timeline.arrival))  # lowest priority, then youngest
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.reserve(seq.seq_id, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Swapped out (its KV kept: `num_computed` stays) where the block manager finds that pays
        and fits, else released to recompute."""
        self.running.remove(seq)
        if (self.preemption_mode != "recompute" and seq.num_computed < seq.num_tokens
                and self.blocks.swap_out(seq.seq_id, seq.num_computed, by_cost=self.preemption_mode == "auto")):
            self.num_swap_preemptions += 1
        else:
            self.blocks.release(seq.seq_id)
            seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self._enqueue(seq, front=True)
        self.num_preemptions += 1


class ArrivalRate:
    """Arrival rate of new requests from their last `window` arrival times (monotonic seconds):
    (arrivals - 1) / (now - oldest), so the estimate falls when arrivals stop. A request
    arriving while a step runs waits for that step before its prefill can start."""

    def __init__(self, window: int = 32) -> None:
        self._times: deque[float] = deque(maxlen=window)

    def observe(self, arrival: float) -> None:
        self._times.append(arrival)

    def rate(self, now: float) -> float:
        if len(self._times) < 2:
            return 0.0
        return (len(self._times) - 1) / max(now - self._times[0], self._times[-1] - self._times[0], 1e-6)


def _append(seq: Sequence, tokens: list[int], eos_token_ids: frozenset[int]) -> SeqUpdate:
    """Appends committed tokens until one finishes the request."""
    committed, text, reason = [], "", None
    for token in tokens:
        commit_token(seq, token)  # the grammar state follows committed tokens only
        seq.token_ids.append(token)
        committed.append(token)
        if token in eos_token_ids:  # ends the request; never text, even when specials are shown
            reason = FinishReason.STOP
            break
        text += seq.detokenizer.add([token])
        if seq.detokenizer.stopped:
            reason = FinishReason.STOP_SEQUENCE
        elif seq.num_output_tokens >= seq.sampling.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            break
    if reason is not None and reason is not FinishReason.STOP_SEQUENCE:
        text += seq.detokenizer.flush()
    return SeqUpdate(seq, committed, text, reason)
