"""The target engine: owns the decode loop on its own thread.

Requests enter with `submit` (from any thread), run in continuous batches, and
hand committed tokens to their stream through the `emit` callback. `abort`
frees a request's blocks at the next step boundary.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from services.common.block_hash import extra_key
from services.common.sampling_params import SamplingConfig
from services.target import metrics
from services.target.engine.block_manager import BlockManager
from services.target.config import EngineConfig
from services.target.speculation.confidence import Confidence
from services.target.output.detokenizer import IncrementalDetokenizer
from services.target.speculation.draft_client import DraftClient
from services.target.engine.engine_types import DuplicateRequest, EngineStats, InvalidRequest, Overloaded
from services.target.engine.kv_events import KVEventLog
from services.target.model.model_runner import ModelRunner, load_model
from services.target.model.model_runner_inputs import StepInput
from services.target.model.sampler import make_generator, sample
from services.target.engine.scheduler import ScheduledSeq, Scheduler, SeqUpdate, StepResult
from services.target.engine.sequence import FinishReason, Sequence, SpeculationPlan, StepOutput
from services.target.speculation.speculator import Speculator, verify_span
from services.target.engine.torch_thread import TorchThread, run_task

log = logging.getLogger(__name__)
_ENGINE_IDS = itertools.count()


class Engine:
    def __init__(self, config: EngineConfig, model, tokenizer, spec,
                 torch_thread: TorchThread | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.spec = spec
        self.name = config.name or config.model_dir.name
        self.instance_id = f"{self.name}-{next(_ENGINE_IDS)}"
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_events = KVEventLog()
        self.runner = ModelRunner(model, spec, self.blocks, config.torch_kv_dtype, config.kernels)
        self._lock = threading.Condition()
        self._incoming: list[Sequence] = []
        self._aborts: set[str] = set()
        self._live: dict[str, Sequence] = {}  # engine thread only
        self._num_pending = 0  # submitted and not finished; guarded by _lock
        self._ids: set[str] = set()  # ids of those requests; guarded by _lock
        self._queued_tokens = 0  # prompt tokens of requests not yet admitted; guarded by _lock
        self._stopped = False
        # All torch work of the engine runs on this one thread (see `load`).
        self._torch_thread = torch_thread or TorchThread()
        self._loop_future = None
        self._tasks: list[tuple] = []  # (fn, args, future) to run on the engine thread between steps
        self._metrics = metrics.register_engine(self)
        self.speculator: Speculator | None = None
        if config.draft_address:
            client = DraftClient(config.draft_address, config.draft_timeout_s, spec.vocab_size,
                                 tls=config.mesh_tls)
            self.speculator = Speculator(client, self.runner.kernels, spec.max_context, self._metrics)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_batched_tokens,
                                   self.speculator.max_draft_nodes if self.speculator else None)
        if self.speculator is not None:
            self.speculator.arrival_rate = self.scheduler.arrival_rate  # arrivals wait for the step

    @classmethod
    def load(cls, config: EngineConfig) -> "Engine":
        """Loads the model on the engine's own thread, where every later step runs too
        (see services/target/engine/torch_thread.py for why)."""
        torch_thread = TorchThread()

        def build() -> "Engine":
            model, tokenizer, spec = load_model(config.model_dir, config.torch_dtype, config.device,
                                               config.weights)
            return cls(config, model, tokenizer, spec, torch_thread)
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

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        if self._loop_future is not None:
            try:
                self._loop_future.result(timeout)
            except Exception:
                log.exception("engine loop ended with an error")
        # Joined, not only told to stop: a process that exits while this thread still runs
        # torch aborts at exit ("terminate called without an active exception", status 134).
        self._torch_thread.shutdown(timeout)
        if self.speculator is not None:
            self.speculator.client.close()

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingConfig,
               emit: Callable[[StepOutput], None], tenant_salt: str = "",
               plan: SpeculationPlan | None = None, bucket: str = "",
               span_context=None, priority: int = 0, report_confidence: bool = False) -> None:
        """Queues a request; raises InvalidRequest or Overloaded without queueing anything.

        `plan` asks for speculative decoding; it is ignored when no draft service is configured.
        `priority` orders admission and preemption; `report_confidence` fills the final
        output's `confidence` (services/target/speculation/confidence.py).
        """
        self.validate(prompt_ids, sampling)
        seq = Sequence(request_id, list(prompt_ids), sampling, make_generator(sampling.seed, self.runner.device),
                       IncrementalDetokenizer(self.tokenizer, prompt_ids, sampling.stop), emit,
                       extra_key=extra_key(self.name, tenant_salt),
                       plan=plan if self.speculator is not None else None,
                       tenant_salt=tenant_salt, bucket=bucket, span_context=span_context,
                       priority=priority, confidence=Confidence() if report_confidence else None)
        with self._lock:
            if self._stopped:
                raise Overloaded("engine is shutting down")
            if request_id in self._ids:
                raise DuplicateRequest(f"request id {request_id!r} is already in flight; use a unique id")
            if self._num_pending >= self.config.max_num_seqs + self.config.max_queued_requests:
                raise Overloaded(f"{self._num_pending} requests in flight; queue limit reached")
            if self._queued_tokens + len(prompt_ids) > self.config.max_queued_tokens:
                raise Overloaded(f"{self._queued_tokens} prompt tokens already queued; "
                                 f"limit {self.config.max_queued_tokens}")
            self._num_pending += 1
            self._ids.add(request_id)
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
                    | self.blocks.seq_ids())

    def kv_snapshot(self):
        """(sequence number, cached blocks) taken together, so events after the number apply on top."""
        with self._lock:
            return self.kv_events.last_sequence, self.blocks.cached_blocks()

    # ---- engine thread ----------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopped or self._incoming or self._aborts or self._tasks
                           or self.scheduler.has_work):
                    self._lock.wait()
                if self._stopped:
                    break
                tasks, self._tasks = self._tasks, []
            for fn, args, future in tasks:
                run_task(fn, args, future)
            with self._lock:
                self._take_incoming()
                batch = self.scheduler.schedule()
                for item in batch:
                    if item.seq.admitted and not item.seq.counted_admission:
                        item.seq.counted_admission = True
                        self._queued_tokens -= item.seq.num_prompt_tokens
                        self._metrics.admitted(item.seq, time.monotonic())
            if batch:
                self._metrics.step(batch)
                try:
                    self._run_step(batch)
                except Exception as exc:  # a failing step fails its requests, never the engine
                    log.exception("engine step failed")
                    with self._lock:
                        for item in batch:
                            self._finish(item.seq, error=exc)
        with self._lock:
            for seq in list(self._live.values()):
                self._finish(seq, error=Overloaded("engine shut down"))
            for _, _, future in self._tasks:
                future.set_exception(RuntimeError("engine shut down"))
            self._tasks.clear()

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

    def _run_step(self, batch: list[ScheduledSeq]) -> None:
        """Run the scheduled batch, then let the scheduler do the bookkeeping; emit what committed."""
        results, failed = self._execute(batch)
        now = time.monotonic()
        with self._lock:
            for item in batch:
                if item.seq.seq_id in failed:
                    self._finish(item.seq, error=failed[item.seq.seq_id])
            for update in self.scheduler.postprocess(batch, results, self.spec.eos_token_ids):
                self._emit(update, now)
            self.kv_events.append(self.blocks.events)
            self.blocks.events = []

    def _execute(self, batch: list[ScheduledSeq]) -> tuple[dict[str, StepResult], dict[str, Exception]]:
        """Draft, forward, sample or accept: new tokens per sequence (and per-sequence failures)."""
        proposals = self.speculator.propose(batch) if self.speculator else {}
        inputs, trees = self._step_inputs(batch, proposals)
        with verify_span(trees, batch, self.speculator):
            logits = self.runner.forward(inputs)  # [num_rows, vocab]
        results: dict[str, StepResult] = {}
        plain, plain_rows, failed = [], [], {}
        offset = 0
        for item, inp in zip(batch, inputs):
            seq, rows = item.seq, logits[offset:offset + inp.num_logits]
            offset += inp.num_logits
            if seq.seq_id in trees:
                try:  # one sequence's sampling failure fails that request only
                    path, bonus = self.speculator.accept(seq, rows, trees[seq.seq_id])
                    if seq.confidence is not None:
                        seq.confidence.add_tree(rows, trees[seq.seq_id], path, bonus)
                    with self._lock:
                        results[seq.seq_id] = self._compact_tree(seq, item.start, trees[seq.seq_id], path, bonus)
                except Exception as exc:
                    log.exception("verify of %s failed", seq.seq_id)
                    failed[seq.seq_id] = exc
            elif item.samples:
                plain.append(item)
                plain_rows.append(rows)
        sampled = sample(torch.cat(plain_rows), [i.seq.sampling for i in plain],
                         [i.seq.generator for i in plain]) if plain else []
        for item, rows, token in zip(plain, plain_rows, sampled):
            if isinstance(token, Exception):
                failed[item.seq.seq_id] = token
                continue
            results[item.seq.seq_id] = StepResult([token])
            if item.seq.confidence is not None:
                item.seq.confidence.add(rows[-1:], [token])
        return results, failed

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

    def _compact_tree(self, seq: Sequence, context_len: int, proposal, path: list[int],
                      bonus: int) -> StepResult:
        """Moves the accepted path's KV into place (lock held); the scheduler frees the rest."""
        src = [context_len + 1 + node for node in path]
        dst = [context_len + 1 + j for j in range(len(path))]
        moves = [(a, b) for a, b in zip(src, dst) if a != b]
        if moves:
            self.runner.move_kv(seq.seq_id, [a for a, _ in moves], [b for _, b in moves])
        return StepResult([proposal.token_ids[node] for node in path] + [bonus],
                          num_computed=context_len + 1 + len(path))  # root + accepted nodes have KV

    def _emit(self, update: SeqUpdate, now: float) -> None:
        """Streams one sequence's committed tokens; finishes it when they ended it (lock held)."""
        seq = update.seq
        if seq.first_token_time is None:
            seq.first_token_time = now
            self._metrics.first_token(seq, now)
        elif seq.last_token_time is not None:
            self._metrics.next_tokens(seq, now, len(update.token_ids))
        seq.last_token_time = now
        seq.emit(StepOutput(update.token_ids, update.text))
        if update.finish_reason is not None:
            self._finish(seq, update.finish_reason)

    def _finish(self, seq: Sequence, reason: FinishReason | None = None,
                error: Exception | None = None) -> None:
        """Frees everything the sequence holds and sends its final message (lock held)."""
        if self._live.pop(seq.seq_id, None) is None:
            return
        self.scheduler.remove(seq)
        self._num_pending -= 1
        self._ids.discard(seq.seq_id)
        if not seq.counted_admission:
            seq.counted_admission = True
            self._queued_tokens -= seq.num_prompt_tokens
        self.kv_events.append(self.blocks.events)
        self.blocks.events = []
        if self.speculator is not None:
            self.speculator.release(seq)
        self._metrics.finished(seq, "error" if error is not None else (reason.value if reason else "error"))
        if reason is FinishReason.ABORTED:
            return  # nobody is listening
        seq.emit(StepOutput([], "", finish_reason=reason, prompt_tokens=seq.num_prompt_tokens,
                            cached_prompt_tokens=seq.num_cached_prompt,
                            completion_tokens=seq.num_output_tokens, error=error,
                            speculation=seq.spec if seq.plan is not None else None,
                            confidence=seq.confidence))
