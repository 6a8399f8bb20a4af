"""The target engine: owns the decode loop on its own thread.

Requests enter with `submit` (from any thread), run in continuous batches, and
hand committed tokens to their stream through the `emit` callback. `abort`
frees a request's blocks at the next step boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.target import metrics
from services.target.block_manager import BlockManager
from services.target.config import EngineConfig
from services.target.detokenizer import IncrementalDetokenizer
from services.target.kv_events import KVEventLog
from services.target.model_runner import ModelRunner, load_model
from services.common.sampling_params import SamplingConfig
from services.target.sampler import make_generator, sample
from services.target.scheduler import Scheduler
from services.target.sequence import FinishReason, Sequence, StepOutput

log = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """The request can never be served as given (maps to INVALID_ARGUMENT)."""


class Overloaded(RuntimeError):
    """Admission limits are reached (maps to RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class EngineStats:
    num_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    block_size: int
    running: int
    waiting: int
    queued_tokens: int
    num_preemptions: int
    evictions: int
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    kv_bytes: int
    fragmentation: float  # allocated-but-unused slots / allocated slots


class Engine:
    def __init__(self, config: EngineConfig, model, tokenizer, spec) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.spec = spec
        self.name = config.name or config.model_dir.name
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_events = KVEventLog()
        self.runner = ModelRunner(model, spec, self.blocks, config.torch_kv_dtype, config.kernels)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_batched_tokens)
        self._lock = threading.Condition()
        self._incoming: list[Sequence] = []
        self._aborts: set[str] = set()
        self._live: dict[str, Sequence] = {}  # engine thread only
        self._num_pending = 0  # submitted and not finished; guarded by _lock
        self._queued_tokens = 0  # prompt tokens of requests not yet admitted; guarded by _lock
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="specmesh-engine", daemon=True)
        self._histograms = metrics.register_engine(self)

    @classmethod
    def load(cls, config: EngineConfig) -> "Engine":
        model, tokenizer, spec = load_model(config.model_dir, config.torch_dtype, config.device)
        return cls(config, model, tokenizer, spec)

    # ---- public API (any thread) ----------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingConfig,
               emit: Callable[[StepOutput], None], tenant_salt: str = "") -> None:
        """Queues a request; raises InvalidRequest or Overloaded without queueing anything."""
        self.validate(prompt_ids, sampling)
        seq = Sequence(request_id, list(prompt_ids), sampling, make_generator(sampling.seed),
                       IncrementalDetokenizer(self.tokenizer, prompt_ids, sampling.stop), emit,
                       extra_key=f"{self.name}\x00{tenant_salt}")
        with self._lock:
            if self._stopped:
                raise Overloaded("engine is shutting down")
            if self._num_pending >= self.config.max_num_seqs + self.config.max_queued_requests:
                raise Overloaded(f"{self._num_pending} requests in flight; queue limit reached")
            if self._queued_tokens + len(prompt_ids) > self.config.max_queued_tokens:
                raise Overloaded(f"{self._queued_tokens} prompt tokens already queued; "
                                 f"limit {self.config.max_queued_tokens}")
            self._num_pending += 1
            self._queued_tokens += len(prompt_ids)
            self._incoming.append(seq)
            self._lock.notify_all()

    def validate(self, prompt_ids: list[int], sampling: SamplingConfig) -> None:
        if not prompt_ids:
            raise InvalidRequest("prompt is empty")
        if sampling.max_tokens > self.config.max_tokens_limit:
            raise InvalidRequest(f"max_tokens {sampling.max_tokens} is above the limit "
                                 f"{self.config.max_tokens_limit}")
        total = len(prompt_ids) + sampling.max_tokens
        if total > self.spec.max_context:
            raise InvalidRequest(f"prompt ({len(prompt_ids)} tokens) plus max_tokens "
                                 f"({sampling.max_tokens}) exceeds the model context "
                                 f"of {self.spec.max_context} tokens")
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if total > capacity:
            raise InvalidRequest(f"prompt plus max_tokens ({total} tokens) exceeds the KV "
                                 f"capacity of {capacity} tokens")

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)
            self._lock.notify_all()

    def stats(self) -> EngineStats:
        with self._lock:
            b = self.blocks.stats()
            allocated, used = self.blocks.slot_usage()
            return EngineStats(
                num_blocks=b.num_blocks, free_blocks=b.free_blocks, used_blocks=b.used_blocks,
                cached_blocks=b.cached_blocks, block_size=self.blocks.block_size,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting) + len(self._incoming),
                queued_tokens=self._queued_tokens, num_preemptions=self.scheduler.num_preemptions,
                evictions=b.evictions, prefix_queries=b.prefix_queries,
                prefix_query_tokens=b.prefix_query_tokens, prefix_hit_tokens=b.prefix_hit_tokens,
                kv_bytes=self.runner.kv_pool.num_bytes,
                fragmentation=(allocated - used) / allocated if allocated else 0.0)

    def live_request_ids(self) -> set[str]:
        """Requests the engine holds any state for (queued, running or holding blocks)."""
        with self._lock:
            return ({*self._live, *(s.seq_id for s in self._incoming)}
                    | set(self.blocks._seqs))

    def kv_snapshot(self):
        """(sequence number, cached blocks) taken together, so events after the number apply on top."""
        with self._lock:
            return self.kv_events.last_sequence, self.blocks.cached_blocks()

    def has_state(self, request_id: str) -> bool:
        """Whether the engine still holds anything for this request (tests, debugging)."""
        with self._lock:
            return (request_id in self._live or self.blocks.has(request_id)
                    or any(s.seq_id == request_id for s in self._incoming))

    # ---- engine thread ----------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopped or self._incoming or self._aborts or self.scheduler.has_work):
                    self._lock.wait()
                if self._stopped:
                    break
                self._take_incoming()
                batch = self.scheduler.schedule()
                for item in batch:
                    if item.seq.admitted and not item.seq.counted_admission:
                        item.seq.counted_admission = True
                        self._queued_tokens -= len(item.seq.prompt_ids)
            if batch:
                self._histograms["batch_size"].record(len(batch))
                self._histograms["batch_tokens"].record(sum(i.num_tokens for i in batch))
                self._run_step(batch)
        with self._lock:
            for seq in list(self._live.values()):
                self._finish(seq, error=Overloaded("engine shut down"))

    def _take_incoming(self) -> None:
        for seq in self._incoming:
            self._live[seq.seq_id] = seq
            self.scheduler.add(seq)
        self._incoming.clear()
        for seq_id in self._aborts:
            seq = self._live.get(seq_id)
            if seq is not None:
                self._finish(seq, FinishReason.ABORTED)
        self._aborts.clear()

    def _run_step(self, batch) -> None:
        try:
            logits = self.runner.forward(batch)  # [num_sampling, vocab]
        except Exception as exc:  # a failing step must not take the engine down
            log.exception("engine step failed")
            with self._lock:
                for item in batch:
                    self._finish(item.seq, error=exc)
            return
        sampling = [item for item in batch if item.samples]
        tokens = sample(logits, [i.seq.sampling for i in sampling], [i.seq.generator for i in sampling])
        now = time.monotonic()
        with self._lock:
            for item in batch:
                seq = item.seq
                seq.num_computed = item.start + item.num_tokens
                if seq.seq_id in self._live:
                    self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_computed, seq.extra_key)
            for item, token in zip(sampling, tokens):
                seq = item.seq
                if seq.seq_id not in self._live:
                    continue
                if seq.first_token_time is None:
                    seq.first_token_time = now
                    self._histograms["ttft"].record(now - seq.arrival)
                elif seq.last_token_time is not None:
                    self._histograms["tpot"].record(now - seq.last_token_time)
                seq.last_token_time = now
                self._commit(seq, token)
            self.kv_events.append(self.blocks.events)
            self.blocks.events = []

    def _commit(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
        text = seq.detokenizer.add([token])
        reason = None
        if seq.detokenizer.stopped:
            reason = FinishReason.STOP_SEQUENCE
        elif token in self.spec.eos_token_ids:
            reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.sampling.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None and reason is not FinishReason.STOP_SEQUENCE:
            text += seq.detokenizer.flush()
        seq.emit(StepOutput([token], text))
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason | None = None,
                error: Exception | None = None) -> None:
        """Frees everything the sequence holds and sends its final message (lock held)."""
        if self._live.pop(seq.seq_id, None) is None:
            return
        self.scheduler.remove(seq)
        self._num_pending -= 1
        if not seq.counted_admission:
            seq.counted_admission = True
            self._queued_tokens -= len(seq.prompt_ids)
        self.kv_events.append(self.blocks.events)
        self.blocks.events = []
        if reason is FinishReason.ABORTED:
            return  # nobody is listening
        seq.emit(StepOutput([], "", finish_reason=reason, prompt_tokens=len(seq.prompt_ids),
                            cached_prompt_tokens=seq.num_cached_prompt,
                            completion_tokens=len(seq.output_ids), error=error))
