"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step mixes decode steps of running sequences and prefill chunks of new
ones under a token budget. When blocks run out, the youngest running sequence
is preempted by recompute: its blocks go back and it is re-queued at the front.
Tenant priority orders both: the waiting queue is highest priority first, and the
lowest-priority (then youngest) running sequence is preempted first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.target.block_manager import BlockManager
from services.target.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # index of the first token computed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last token, so a new token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_batched_tokens: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._enqueue(seq, front=False)

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

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
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
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            match = self.blocks.match_prefix(seq.token_ids, seq.extra_key)
            n = min(seq.num_tokens - match.num_tokens, budget)
            if not self.blocks.can_admit(match, match.num_tokens + n):
                break  # FIFO: don't let later requests overtake
            self.blocks.admit(seq.seq_id, match, match.num_tokens + n, seq.num_prompt_tokens)
            self.waiting.popleft()
            seq.num_computed = match.num_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_prompt = min(match.num_tokens, seq.num_prompt_tokens)
            seq.status = SeqStatus.RUNNING
            seq.admitted = True
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        return batch

    def _reserve_or_preempt(self, seq: Sequence, num_tokens: int, batch: list[ScheduledSeq]) -> bool:
        """Reserves room for `seq`, preempting the youngest unscheduled running sequences if needed."""
        scheduled = None  # built only when room must be made (rare), not on every decode
        while not self.blocks.can_reserve(seq.seq_id, num_tokens):
            scheduled = scheduled or {id(item.seq) for item in batch}
            victim = max((s for s in self.running if id(s) not in scheduled),
                         key=lambda s: (-s.priority, s.arrival))  # lowest priority, then youngest
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.reserve(seq.seq_id, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.seq_id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self._enqueue(seq, front=True)
        self.num_preemptions += 1
