"""The target engine: owns the decode loop on its own thread.

Requests enter with `submit` (from any thread), run in continuous batches, and
hand committed tokens to their stream through the `emit` callback. `abort`
frees a request's blocks at the next step boundary.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from services.common.block_hash import block_hash, extra_key
from services.common.large_allocations import keep_large_allocations_on_heap
from services.common.sampling_params import SamplingConfig
from services.target import metrics
from services.target.engine.argmax_rows import argmax_rows
from services.target.engine.block_manager import BlockManager, tier_event
from services.target.config import EngineConfig
from services.target.speculation.confidence import Confidence
from services.target.output.detokenizer import IncrementalDetokenizer
from services.target.speculation.draft_client import DraftClient
from services.target.engine.engine_types import (DuplicateRequest, EngineFailed, EngineStats, InvalidRequest,
                                                 Overloaded, RankLost)
from services.target.engine.fault_point import FaultPoint
from services.target.engine.loop_mailbox import held
from services.target.speculation.no_draft_service import NoDraftService
from services.target.structured.compiler import ConstraintCompiler
from services.target.structured.grammar_state import GrammarState
from services.target.structured.vocab_subsets import step_vocab_subsets
from services.target.structured.hooks import servable_plan
from services.target.engine.host_tier import build_host_tier, engine_stat_fields
from services.target.engine.kv_precision import ColdPrecision, PoolLayout, build_cold_precision
from services.target.engine import shared_tier
from services.target.engine.kv_events import KVEventLog
from services.target.model.model_runner import ModelRunner, load_model
from services.target.model.model_runner_inputs import StepInput, split_logits
from services.target.model.logits_processors import LogitsProcessor
from services.target.model.sampler import make_generator
from services.common.sample_count import sample_count_violations
from services.target.engine.plain_sampling import sample_plain
from services.target.engine.samples import SampleGroup, sample_id, sample_seed
from services.target.engine.scheduler import ScheduledSeq, Scheduler, SeqUpdate, StepResult
from services.target.engine.step_log import FirstToken, StepLog, StepRecord
from services.target.engine.sequence import FinishReason, Sequence, SpeculationPlan, StepOutput
from services.target.speculation.prefix_features import PrefixFeatures
from services.target.speculation.speculator import Speculator, verify_span
from services.target.engine.torch_thread import TorchThread, run_task
from services.target.tp.launch import start_ranks

log = logging.getLogger(__name__)
_ENGINE_IDS = itertools.count()


class Engine:
    def __init__(self, config: EngineConfig, model, tokenizer, spec,
                 torch_thread: TorchThread | None = None, ranks=None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.spec = spec
        self.name = config.name or config.model_dir.name
        self.instance_id = f"{self.name}-{next(_ENGINE_IDS)}"
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_events = KVEventLog()
        # The other ranks of a tensor-parallel target (services/target/tp/launch.py), or None.
        self.ranks = ranks
        self.runner = ModelRunner(model, spec, self.blocks, config.torch_kv_dtype, config.kernels,
                                  tp=ranks.tp if ranks else None)
        if ranks is not None and config.kv_host_bytes:
            log.warning("host tier off: it does not hold a tensor-parallel target's KV shards yet")
        cold = self.cold_precision = self._cold_precision(config, spec)  # shown by GetStats
        self.blocks.attach_host_tier(build_host_tier(config.kv_host_bytes if ranks is None else 0, self.name,
                                                     config.torch_kv_dtype,
                                                     config.block_size, self.runner.kv_block_bytes, cold))
        if self.blocks.host_tier is not None:
            self.blocks.attach_shared_tier(shared_tier.build_shared_tier(
                config.kv_shared_url, config.kv_shared_prefix, config.kv_shared_bytes, config.kv_shared_ttl_s,
                config.kv_shared_timeout_ms / 1000, self.blocks.host_tier.identity))
            for name, tier in (("host", self.blocks.host_tier), ("shared", self.blocks.shared_tier)):
                if tier is not None:  # what the tiers hold reaches the prefix index as KV events
                    tier.on_event = functools.partial(self._tier_event, name)
        self._lock = threading.Condition()
        self._incoming: list[Sequence] = []
        self._aborts: set[str] = set()
        self._live: dict[str, Sequence] = {}  # engine thread only
        self._num_pending = 0  # submitted and not finished; guarded by _lock
        self._ids: set[str] = set()  # ids of those requests; guarded by _lock
        self._queued_tokens = 0  # prompt tokens of requests not yet admitted; guarded by _lock
        self._queued: set[str] = set()  # the requests (leaders) counted in _queued_tokens; guarded by _lock
        self._stopped = False
        self._rank_lost: RankLost | None = None  # a rank died while no step ran (`_lose_rank`)
        # All torch work of the engine runs on this one thread (see `load`).
        self._torch_thread = torch_thread or TorchThread()
        self._loop_future = None
        self._tasks: list[tuple] = []  # (fn, args, future) to run on the engine thread between steps
        self._metrics = metrics.register_engine(self)
        self.failure: EngineFailed | None = None  # set when the loop died (`_fail`)
        self._failure_callbacks: list[Callable[[EngineFailed], None]] = []
        self.loop_fault = FaultPoint("engine.loop")  # test hook (services/target/engine/fault_point.py)
        self.num_steps = 0  # engine steps run: a heartbeat GetStats reports
        self.step_log = StepLog()  # what each step carried, what each first token waited for
        # Always a speculator: without a draft service it verifies the target's own drafts
        # (grammar drafts); every other plan is dropped at submit (`servable_plan`).
        client = DraftClient(config.draft_address, config.draft_timeout_s, spec.vocab_size,
                             tls=config.mesh_tls) if config.draft_address else NoDraftService()
        self.speculator: Speculator | None = Speculator(client, self.runner.kernels, spec.max_context,
                                                        self._metrics, self.runner, self._lock)
        self.grammars = ConstraintCompiler(tokenizer, spec.vocab_size, spec.eos_token_ids,
                                           cache_dir=config.grammar_cache_dir,
                                           timeout_s=config.grammar_compile_timeout_s,
                                           max_grammar_bytes=config.grammar_max_bytes)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_batched_tokens,
                                   self.speculator.max_draft_nodes if self.speculator else None,
                                   preemption_mode=config.preemption_mode)
        if self.speculator is not None:
            self.speculator.arrival_rate = self.scheduler.arrival_rate  # arrivals wait for the step
            self.speculator.queue_length = self._queue_length  # so do requests already queued
            self.speculator.seats_full = self.scheduler.seats_full  # saturated: batch-mates' TPOT is bounded
            if config.enable_prefix_caching and config.feature_cache_bytes:  # a feature head's cached prefixes
                self.speculator.attach_prefix_features(PrefixFeatures(config.block_size, config.feature_cache_bytes),
                                                       self.blocks.prefix_hashes)
                self.scheduler.prefix_limit = self.speculator.reusable_prefix
        if ranks is not None:
            ranks.tp.on_lost(self._lose_rank)

    def _cold_precision(self, config: EngineConfig, spec) -> ColdPrecision:
        """The host tier's precision policy for long prefixes' later blocks (kv_precision.py)."""
        if not config.kv_host_bytes:  # no tier: nothing to decide (EngineConfig refuses "fp8" without one)
            return ColdPrecision("off", config.kv_cold_after_tokens, None, "no host tier")
        layout = PoolLayout(spec.num_layers, config.block_size, spec.num_kv_heads, spec.head_dim,
                            config.torch_kv_dtype)
        if layout.full_bytes != self.runner.kv_block_bytes:  # a pool of another shape than one head_dim for all
            if config.kv_cold_precision == "fp8":
                raise ValueError("kv_cold_precision 'fp8': this model's KV pool is not one shape per layer")
            return ColdPrecision("off", config.kv_cold_after_tokens, None, "the pool is not one shape per layer")
        cold = build_cold_precision(config.kv_cold_precision, config.kv_cold_after_tokens, layout, config.model_dir)
        log.info("host tier precision: %s (%s)", cold.mode, cold.reason)
        return cold

    @classmethod
    def load(cls, config: EngineConfig) -> "Engine":
        """Loads the model on the engine's own thread, where every later step runs too
        (see services/target/engine/torch_thread.py for why)."""
        keep_large_allocations_on_heap()  # a step's logits buffers are tens of MB: reuse, not fresh pages
        torch_thread = TorchThread()

        def build() -> "Engine":
            ranks = start_ranks(config) if config.tensor_parallel > 1 else None  # from this thread: see follower.py
            try:
                model, tokenizer, spec = load_model(config.model_dir, config.torch_dtype, config.device,
                                                   config.weights, chat_template=config.chat_template,
                                                   fuse=config.forward == "auto",
                                                   tp=ranks.tp if ranks else None)
                if ranks is not None:
                    ranks.tp.barrier()  # every rank loaded its shard
                return cls(config, model, tokenizer, spec, torch_thread, ranks)
            except BaseException:
                if ranks is not None:
                    ranks.kill()
                raise
        return torch_thread.submit(build).result()

    # ---- public API (any thread) ----------------------------------------
    def run_on_engine_thread(self, fn, *args):
        """Runs `fn(*args)` on the engine's torch thread and returns its result.

        For side-by-side benchmarks: a baseline run here shares the engine's OpenMP team
        instead of contending with it (see `load`).
        """
        if self._loop_future is None:
            return self._torch_thread.submit(fn, *args).result()
        future: Future = Future()
        with self._lock:  # the loop runs it between two steps
            self._tasks.append((fn, args, future))
            self._lock.notify_all()
        return future.result()

    def start(self) -> None:
        """Starts the decode loop (idempotent)."""
        if self._loop_future is not None:
            return
        if self.speculator is not None:
            self.speculator.client.connect()
        self._loop_future = self._torch_thread.submit(self._loop)

    @property
    def alive(self) -> bool:
        """The decode loop is running (started, not stopped, not failed)."""
        future = self._loop_future
        return future is not None and not future.done() and self.failure is None and not self._stopped

    def inject_loop_fault(self) -> None:
        """Test hook: the loop fails at its next iteration, outside a step (busy or idle)."""
        with self._lock:
            self.loop_fault.arm()
            self._lock.notify_all()

    def on_failure(self, callback: Callable[[EngineFailed], None]) -> None:
        """Calls `callback(error)` on the engine thread if the loop dies (at once if it has)."""
        with self._lock:
            failure = self.failure
            if failure is None:
                self._failure_callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        if self._loop_future is not None:
            try:
                self._loop_future.result(timeout)
            except Exception:
                if self.failure is None:  # a failure was logged when it happened
                    log.exception("engine loop ended with an error")
        # Joined, not only told to stop: a process that exits while this thread still runs
        # torch aborts at exit ("terminate called without an active exception", status 134).
        if self.ranks is not None:  # on the thread that started them and sent them every step
            self._torch_thread.submit(self.ranks.stop)
        self._torch_thread.shutdown(timeout)
        self.grammars.close()
        if self.blocks.shared_tier is not None:
            self.blocks.shared_tier.close()
        if self.speculator is not None:
            self.speculator.client.close()

    def prefetch_shared(self, prompt_ids: list[int], tenant_salt: str = "") -> int:
        """Loads the prompt's blocks that the shared tier holds, past those this replica holds,
        into the host tier (blocking: call it off the engine thread and the event loop, before
        `submit`); returns how many. 0 when the shared tier is off, empty or down."""
        shared, host = self.blocks.shared_tier, self.blocks.host_tier
        if shared is None or host is None or not host.restore_pays():
            return 0  # off, or restoring is measured dearer than recomputing: nothing would be restored
        key_extra, bs = extra_key(self.name, tenant_salt), self.blocks.block_size
        chain, parent = [], None
        for i in range((len(prompt_ids) - 1) // bs):  # as match_prefix: the last token is computed
            key = (parent, tuple(prompt_ids[i * bs:(i + 1) * bs]), key_extra)
            parent = block_hash(*key)
            chain.append((parent, key))
        try:
            return shared_tier.prefetch(self.blocks, host, shared, chain)
        except Exception:  # a shared-tier fault costs a recompute, never the request
            log.exception("shared tier: prefetch failed")
            return 0

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingConfig,
               emit: Callable[[StepOutput], None], tenant_salt: str = "",
               plan: SpeculationPlan | None = None, bucket: str = "",
               span_context=None, priority: int = 0, report_confidence: bool = False,
               n: int = 1, grammar=None) -> None:
        """Queues a request; raises InvalidRequest or Overloaded without queueing anything.

        `plan` asks for speculative decoding; it is dropped where the target cannot serve it
        (services/target/structured/hooks.servable_plan: no draft service, or a grammar plan
        without a constraint).
        `priority` orders admission and preemption; `report_confidence` fills the final
        output's `confidence` (services/target/speculation/confidence.py). `n` > 1 samples the
        prompt n times over one prefill (services/target/engine/samples.py); outputs carry
        their sample's `index`. `grammar` is the request's compiled constraint
        (`self.grammars.compile`), None when unconstrained; each sample keeps its own state.
        """
        n = max(n, 1)
        self.validate(prompt_ids, sampling, n)
        group = SampleGroup(request_id, n, emit) if n > 1 else None

        def new_sample(index: int) -> Sequence:
            return Sequence(
                sample_id(request_id, index), list(prompt_ids), sampling,
                make_generator(sample_seed(sampling.seed, index), self.runner.device),
                IncrementalDetokenizer(self.tokenizer, prompt_ids, sampling.stop,
                                       sampling.skip_special_tokens, sampling.min_tokens),
                group.emitter(index) if group else emit, extra_key=extra_key(self.name, tenant_salt),
                plan=servable_plan(plan, grammar is not None, bool(self.config.draft_address)),
                tenant_salt=tenant_salt, bucket=bucket, span_context=span_context if index == 0 else None,
                priority=priority, confidence=Confidence() if report_confidence else None,
                group=group, index=index,
                # each sample's penalties count its own output
                logits_processor=LogitsProcessor.for_request(sampling, self.spec.eos_token_ids,
                                                             len(prompt_ids)),
                grammar=GrammarState(grammar, self.spec.vocab_size, self.grammars.utf8_guard,
                                     self.grammars.encode)
                if grammar is not None else None)
        seq = new_sample(0)
        seq.followers = [new_sample(i) for i in range(1, n)]
        with self._lock:
            if self.failure is not None:
                raise EngineFailed(str(self.failure))
            if self._stopped:
                raise Overloaded("engine is shutting down")
            if request_id in self._ids or any(f.seq_id in self._ids for f in seq.followers):
                raise DuplicateRequest(f"request id {request_id!r} is already in flight; use a unique id")
            if self._num_pending + n > self.config.max_num_seqs + self.config.max_queued_requests:
                raise Overloaded(f"{self._num_pending} requests in flight; queue limit reached")
            if self._queued_tokens + len(prompt_ids) > self.config.max_queued_tokens:
                raise Overloaded(f"{self._queued_tokens} prompt tokens already queued; "
                                 f"limit {self.config.max_queued_tokens}")
            self._num_pending += n  # admission counts the samples
            self._ids.update([request_id, *(f.seq_id for f in seq.followers)])
            self._queued_tokens += len(prompt_ids)  # the prompt is queued once, for its leader
            self._queued.add(seq.seq_id)
            self._incoming.append(seq)
            self._lock.notify_all()

    def validate(self, prompt_ids: list[int], sampling: SamplingConfig, n: int = 1) -> None:
        if not prompt_ids:
            raise InvalidRequest("prompt is empty")
        problems = sample_count_violations(n, sampling.seed, min(self.config.max_samples, self.config.max_num_seqs))
        if problems:
            raise InvalidRequest("; ".join(message for _, message in problems))
        if sampling.max_tokens > self.config.max_tokens_limit:
            raise InvalidRequest(f"max_tokens {sampling.max_tokens} is above the limit "
                                 f"{self.config.max_tokens_limit}")
        total = len(prompt_ids) + sampling.max_tokens
        if total > self.spec.max_context:
            raise InvalidRequest(f"prompt ({len(prompt_ids)} tokens) plus max_tokens "
                                 f"({sampling.max_tokens}) exceeds the model context "
                                 f"of {self.spec.max_context} tokens")
        unknown = [t for t, _ in sampling.logit_bias if t >= self.spec.vocab_size]
        if unknown:
            raise InvalidRequest(f"sampling.logit_bias: token id {unknown[0]} is not in the vocabulary "
                                 f"(ids 0 .. {self.spec.vocab_size - 1})", "sampling.logit_bias")
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
                swap_preemptions=self.scheduler.num_swap_preemptions,
                recompute_preemptions=self.scheduler.num_preemptions - self.scheduler.num_swap_preemptions,
                evictions=b.evictions, prefix_queries=b.prefix_queries,
                prefix_query_tokens=b.prefix_query_tokens, prefix_hit_tokens=b.prefix_hit_tokens,
                kv_bytes=self.runner.kv_pool.num_bytes, kv_block_bytes=self.runner.kv_block_bytes,
                fragmentation=(allocated - used) / allocated if allocated else 0.0,
                prompt_tokens_computed=self.scheduler.prompt_tokens_computed,
                **engine_stat_fields(self.blocks.host_tier, self.blocks.block_size),
                **shared_tier.engine_stat_fields(self.blocks.shared_tier),
                host_tier_cold_setting=self.config.kv_cold_precision, host_tier_cold_reason=self.cold_precision.reason
                if self.blocks.host_tier is not None else "no host tier")

    def live_request_ids(self) -> set[str]:
        """Requests the engine holds any state for (queued, running or holding blocks)."""
        with self._lock:
            return ({*self._live, *(s.seq_id for s in self._incoming)}
                    | self.blocks.seq_ids())

    def kv_snapshot(self):
        """(sequence number, cached blocks of every tier) taken together, so events after the number
        apply on top (tier events may also be in both: applying them again changes nothing)."""
        with self._lock:
            after, blocks = self.kv_events.last_sequence, self.blocks.cached_blocks()
            for name, tier in (("host", self.blocks.host_tier), ("shared", self.blocks.shared_tier)):
                if tier is not None:
                    blocks += [tier_event("stored", name, h, key) for h, key in tier.held()]
            return after, blocks

    def _tier_event(self, tier: str, kind: str, block_hash: int, key: tuple) -> None:
        """A host- or shared-tier entry came or went (any thread): one KV event."""
        self.kv_events.append([tier_event(kind, tier, block_hash, key)])

    # ---- engine thread ----------------------------------------------------
    def _loop(self) -> None:
        """The decode loop, supervised: a fault outside a step's own try fails the engine as a
        whole (`_fail`): every live request ends with INTERNAL, new ones are refused and the
        `on_failure` callbacks tell the server (NOT_SERVING, then exit for a restart)."""
        try:
            self._run_loop()
        except BaseException as exc:
            log.critical("engine loop failed outside a step; the engine stops: %r", exc, exc_info=exc)
            self._fail(exc)
            raise
        with self._lock:
            for seq in list(self._live.values()):
                self._finish(seq, error=Overloaded("engine shut down"))
            for _, _, future in self._tasks:
                future.set_exception(RuntimeError("engine shut down"))
            self._tasks.clear()

    def _run_loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopped or self._incoming or self._aborts or self._tasks
                           or self.scheduler.has_work or self.loop_fault.armed or self._rank_lost):
                    self._lock.wait()
                if self._stopped:
                    return
                if self._rank_lost is not None:
                    raise self._rank_lost
                tasks, self._tasks = self._tasks, []
            for fn, args, future in tasks:
                run_task(fn, args, future)
            with self._lock:
                self._take_incoming()
                batch = self.scheduler.schedule()
                self.loop_fault.check()  # a test's fault here: mid-bookkeeping, state untrusted
                batch = self._count_admissions(batch)
                waiting = len(self.scheduler.waiting)
            if batch:
                self.num_steps += 1
                started = time.monotonic()
                decoding = _decode_rows(batch)  # before the step: afterwards every row looks like a prompt chunk
                try:
                    self._metrics.step(batch)
                except Exception:  # metrics only: nothing else depends on them
                    log.exception("engine step metrics failed")
                try:
                    self._run_step(batch)
                except RankLost:  # the replica cannot compute any step: the engine fails (`_loop`)
                    raise
                except Exception as exc:  # a failing step fails its requests, never the engine
                    log.exception("engine step failed")
                    with self._lock:
                        for item in batch:
                            self._finish(item.seq, error=exc)
                self._log_step(batch, started, waiting, decoding)

    def _queue_length(self) -> int:
        """Requests that wait for the running step before they can start: queued in the
        scheduler, or submitted since it scheduled (engine thread; a racy read of the
        incoming list is fine: a request arriving a moment later waits as well)."""
        return len(self.scheduler.waiting) + len(self._incoming)

    def _log_step(self, batch: list[ScheduledSeq], started: float, waiting: int, decoding: int) -> None:
        draft_s, nodes, trees = self.speculator.last_step if self.speculator else (0.0, 0, 0)
        self.step_log.steps.append(StepRecord(
            self.num_steps, started, time.monotonic(), draft_s,
            prefill_tokens=sum(item.num_tokens for item in batch) - decoding, decode_rows=decoding,
            draft_nodes=nodes, trees=trees, waiting=waiting))

    def _count_admissions(self, batch: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Admission bookkeeping (lock held); a request whose admission metrics fail ends with
        that error and leaves the batch, the others run."""
        failed = set()
        for item in batch:
            if item.seq.admitted and self._unqueue(item.seq):
                try:
                    self._metrics.admitted(item.seq, time.monotonic())
                except Exception as exc:
                    log.exception("admission of %s failed", item.seq.seq_id)
                    failed.add(item.seq.seq_id)
                    self._finish(item.seq, error=exc)
        return [item for item in batch if item.seq.seq_id not in failed] if failed else batch

    def _unqueue(self, seq: Sequence) -> bool:
        """Takes a request's prompt off the queued-token count, once (lock held); True if it was on."""
        if seq.seq_id not in self._queued:
            return False
        self._queued.discard(seq.seq_id)
        self._queued_tokens -= seq.num_prompt_tokens
        return True

    def _fail(self, exc: BaseException) -> None:
        """The loop died outside a step: end every live request with an error at once, refuse
        new ones, and tell the `on_failure` callbacks. Touches no scheduler or block state."""
        error = exc if isinstance(exc, RankLost) else EngineFailed(
            f"engine failed outside a step ({type(exc).__name__}: {exc}); the replica stops and restarts")
        with self._lock:
            self.failure = error
            self._stopped = True
            seqs = {s.seq_id: s for s in [*self._live.values(), *self._incoming]}
            self._live.clear()
            self._incoming.clear()
            tasks, self._tasks = self._tasks, []
            callbacks = list(self._failure_callbacks)
        for seq in seqs.values():
            try:
                seq.emit(StepOutput([], "", error=error))
            except Exception:
                log.exception("could not fail request %s", seq.seq_id)
        for _, _, future in tasks:
            future.set_exception(error)
        if self.speculator is not None:
            try:
                self.speculator.client.release(list(seqs))
            except Exception:
                log.exception("draft release after the engine failure failed")
        for callback in callbacks:
            try:
                callback(error)
            except Exception:
                log.exception("engine failure callback failed")

    def _lose_rank(self, error: RankLost) -> None:
        """A rank of this tensor-parallel target died (any thread): the loop fails with `error`
        at once, busy or idle (`_loop`, `_fail`)."""
        with self._lock:
            self._rank_lost = error
            self._lock.notify_all()

    def _take_incoming(self) -> None:
        for seq in self._incoming:
            for sample in (seq, *seq.followers):  # followers wait on seq outside the queues
                self._live[sample.seq_id] = sample
            self.scheduler.add(seq)
        self._incoming.clear()
        for seq_id in self._aborts:
            seq = self._live.get(seq_id)
            if seq is not None:
                self._finish(seq, FinishReason.ABORTED)
            self._finish_samples(seq_id, FinishReason.ABORTED)  # every sample of the request
        self._aborts.clear()

    def _run_step(self, batch: list[ScheduledSeq]) -> None:
        """Run the scheduled batch, then let the scheduler do the bookkeeping; emit what committed."""
        results, failed = self._execute(batch)
        now = time.monotonic()
        with self._lock, held():  # the step's outputs reach the server's loop with one wake-up
            for seq_id, exc in failed.items():  # batch items, and followers sampled with them
                if seq_id in self._live:
                    self._finish(self._live[seq_id], error=exc)
            for update in self.scheduler.postprocess(batch, results, self.spec.eos_token_ids):
                self._emit(update, now)
            self.kv_events.append(self.blocks.drain_events())

    def _execute(self, batch: list[ScheduledSeq]) -> tuple[dict[str, StepResult], dict[str, Exception]]:
        """Propose -> forward -> verify the draft trees, sample the other rows: new tokens per
        sequence, and per-sequence failures (a failure fails that request alone)."""
        self.runner.move_tiers(self.blocks.take_tier_moves())  # host tier: evicted blocks out, hits in
        self.runner.copy_blocks(self.blocks.take_copies())  # copy-on-write, before any KV is written
        proposals = self.speculator.propose(batch) if self.speculator else {}
        inputs, trees = self._step_inputs(batch, proposals)
        want = self.speculator.feature_seqs(batch) if self.speculator else frozenset()
        # Grammar-restricted rows: logits over their allowed tokens only (structured/vocab_subsets.py)
        subsets = step_vocab_subsets(batch, inputs, trees, self.spec.vocab_size) \
            if self.config.grammar_vocab_subsets and self.runner.takes_vocab_subsets \
            and any(item.seq.grammar is not None for item in batch) else None
        if getattr(self.runner, "takes_argmax_rows", False):  # greedy rows no one else reads: the argmax screen
            subsets = {**argmax_rows(batch, inputs, trees), **(subsets or {})} or None
        # Only a step with subset rows passes them: the runner's plain signature stays the common path.
        extra = {"vocab_subsets": subsets} if subsets else {}
        with verify_span(trees, batch, self.speculator):
            if want:  # EAGLE: the features of those sequences' rows too
                logits, features = self.runner.forward_with_features(inputs, want, **extra)
            else:
                logits, features = self.runner.forward(inputs, **extra), {}  # [num_rows, vocab]
        rows = split_logits(logits, inputs)  # per batch item: [num_logits, vocab]
        deferred = {r for r, ids in subsets.items() if ids is None} if subsets else set()  # leaf rows left out
        verified, failed = self.speculator.verify(batch, rows, trees, deferred) if trees else ({}, {})
        if features:
            self.speculator.keep_features(inputs, features, trees)
        sampled, sampling_failed = sample_plain(batch, rows, trees)
        return {**verified, **sampled}, {**failed, **sampling_failed}

    def _step_inputs(self, batch, proposals) -> tuple[list[StepInput], dict]:
        """One StepInput per scheduled sequence; a tree where the proposal fits the slots the
        scheduler reserved for it (budget and blocks), else the plain chunk."""
        inputs, trees = [], {}
        for item in batch:
            seq = item.seq
            proposal = proposals.get(seq.seq_id)
            if proposal is not None and len(proposal.token_ids) <= item.num_draft_slots:
                inputs.append(StepInput.tree(seq.seq_id, seq.token_ids[-1], item.start,
                                             proposal.token_ids, proposal.parents, proposal.depths))
                trees[seq.seq_id] = proposal
            else:
                tokens = seq.token_ids[item.start:item.start + item.num_tokens]
                inputs.append(StepInput.chunk(seq.seq_id, tokens, item.start, item.samples))
        return inputs, trees

    def _emit(self, update: SeqUpdate, now: float) -> None:
        """Streams one sequence's committed tokens; finishes it when they ended it (lock held)."""
        seq = update.seq
        if self._metrics.emitted(seq, now, len(update.token_ids)):  # its first token
            timeline = seq.timeline
            self.step_log.first_tokens.append(FirstToken(
                seq.request_id, seq.bucket, timeline.arrival, timeline.admitted or now, now,
                seq.num_cached_prompt, seq.num_prompt_tokens))
        seq.emit(StepOutput(update.token_ids, update.text, logprobs=update.logprobs))
        if update.finish_reason is not None:
            self._finish(seq, update.finish_reason)

    def _finish(self, seq: Sequence, reason: FinishReason | None = None,
                error: Exception | None = None) -> None:
        """Frees everything the sequence holds and sends its final message (lock held)."""
        if self._live.pop(seq.seq_id, None) is None:
            return
        self.scheduler.remove(seq)
        self._num_pending -= 1
        if seq.group is None or seq.index > 0:
            self._ids.discard(seq.seq_id)
        if seq.group is not None and not self._samples(seq.request_id):
            self._ids.discard(seq.request_id)  # taken until the request's last sample ends
        self._unqueue(seq)
        self.kv_events.append(self.blocks.drain_events())
        if self.speculator is not None:
            self.speculator.release(seq)
        self._metrics.finished(seq, "error" if error is not None else (reason.value if reason else "error"))
        if error is not None and seq.group is not None:
            self._finish_samples(seq.request_id, FinishReason.ABORTED)  # the request fails whole
        if reason is FinishReason.ABORTED:
            return  # nobody is listening
        seq.emit(StepOutput([], "", finish_reason=reason, prompt_tokens=seq.num_prompt_tokens,
                            cached_prompt_tokens=seq.num_cached_prompt,
                            host_cached_prompt_tokens=seq.num_host_cached_prompt,
                            shared_cached_prompt_tokens=seq.num_shared_cached_prompt,
                            completion_tokens=seq.num_output_tokens, error=error,
                            speculation=seq.spec if seq.plan is not None else None,
                            confidence=seq.confidence))

    def _samples(self, request_id: str) -> list[Sequence]:
        """The live sequences of a request's n > 1 samples (lock held)."""
        found = []
        for seq in self._live.values():
            if seq.group is not None and seq.group.request_id == request_id:
                found.append(seq)
        return found

    def _finish_samples(self, request_id: str, reason: FinishReason) -> None:
        for seq in self._samples(request_id):
            self._finish(seq, reason)


def _decode_rows(batch: list[ScheduledSeq]) -> int:
    """Rows of a scheduled step that decode a generated token (the rest are prompt chunks)."""
    return sum(1 for item in batch if item.samples and item.num_tokens == 1 and item.seq.num_output_tokens > 0)
