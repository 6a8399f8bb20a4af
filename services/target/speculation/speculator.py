"""Speculation inside the engine step: ask the draft service for trees, accept after verify.

The engine owns the loop; this module decides which sequences speculate this step
(`propose`), and after the forward pass verifies each draft tree (`verify`): walks the
target's outputs over it (greedy match, or lossless rejection sampling when temperature
> 0), adds the committed tokens to the request's confidence, and moves the accepted
path's KV into place.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from services.common.draft_tree import DraftTree
from services.common.speculation_cost import LoadAwareDepth, expected_tokens, sequence_alpha
from services.target.speculation.draft_client import DraftClient, DraftRequest, draft_seed
from services.target.speculation.features import MAX_FEATURE_BYTES, FeatureBuffer, fit_features
from services.target.speculation.prefix_features import PrefixFeatures
from specmesh.proto.v1 import common_pb2
from services.target.model.logits_processors import tree_paths
from services.target.model.logprobs import token_logprobs
from services.target.model.sampler import row_argmax, target_probs
from services.target.kernels.tree_accept import sample_inverse_cdf
from services.target.engine.scheduler import ScheduledSeq, StepResult
from services.target.engine.sequence import Sequence
from services.target.structured.hooks import (FORCED_PRIOR, draft_service_method, forced_chain, grammar_draft,
                                              grammar_pruned, masked_verify_row, masked_verify_rows)

log = logging.getLogger(__name__)


@contextlib.contextmanager
def verify_span(trees: dict, batch, speculator: "Speculator | None" = None):
    """Times the step's forward pass: feeds the speculator's step-cost model (every step),
    and for a step that checks draft trees notes the pass on each speculating sequence
    (`accept` completes it). The request's `verify` span (with one event per pass) is written
    from these notes when it finishes (services/target/metrics.py), so there is no per-step
    span outside the requests' traces."""
    start = time.monotonic()
    yield
    end = time.monotonic()
    if speculator is not None:
        nodes = sum(len(t.token_ids) for t in trees.values())
        tokens = sum(i.num_tokens for i in batch) + nodes
        rows = sum(1 for i in batch if i.samples) + nodes  # logit rows: sampled positions, tree nodes
        speculator.load.cost.observe(tokens, end - start, rows, len(trees))
        speculator.last_step = (speculator.last_step[0], nodes, len(trees))
    for item in batch:
        tree = trees.get(item.seq.seq_id)
        if tree is not None:
            spec = item.seq.spec
            spec.passes.append([*spec.draft_window, start, end, len(tree.token_ids), 0])


class Speculator:
    def __init__(self, client: DraftClient, kernels, max_context: int, metrics, runner=None,
                 engine_lock=None) -> None:
        """`runner`: the model runner whose KV `verify` compacts (`move_kv`); `engine_lock`: the
        engine's lock, held while it does, since the move reads block tables that other threads
        read under that lock (stats, live ids)."""
        self.client = client
        self.kernels = kernels
        self.max_context = max_context
        self._metrics = metrics  # services/target/metrics.TargetMetrics
        self.runner = runner
        self.engine_lock = engine_lock or threading.Lock()
        self.load = LoadAwareDepth()  # measured step and draft times -> depth per step
        self.arrival_rate: Callable[[], float] = lambda: 0.0  # the scheduler's, set by the engine
        self.queue_length: Callable[[], int] = lambda: 0  # requests waiting for the step, set by the engine
        self.seats_full: Callable[[], bool] = lambda: False  # every seat taken (saturated), set by the engine
        # The last step's (draft call seconds, draft nodes verified, trees) for the step log.
        self.last_step: tuple[float, int, int] = (0.0, 0, 0)
        self.features = FeatureBuffer()  # EAGLE: features of committed positions not yet sent
        # EAGLE: features of cached prefix blocks (`attach_prefix_features`; None = not kept), the
        # block manager's hashes of a sequence's blocks, and where each sequence's sent features end.
        self.prefix_features: PrefixFeatures | None = None
        self._prefix_hashes: Callable[[str], list[int]] = lambda _seq_id: []
        self._sent_end: dict[str, int] = {}
        self._committed_rows: dict[str, list[int]] = {}  # this step's verified trees: rows committed
        self._forced: set[str] = set()  # this step's sequences whose tree is their grammar's forced chain

    def propose(self, batch: list[ScheduledSeq]) -> dict[str, DraftTree]:
        """One batched draft call for every decoding sequence with a plan; {} on fallback."""
        seqs, requests = [], []
        self.last_step = (0.0, 0, 0)
        slots = {item.seq.seq_id: item.num_draft_slots for item in batch}  # budgeted by the scheduler
        # What each constrained sequence's grammar forces next: drafted by the target itself.
        chains = {item.seq.seq_id: chain for item in batch if self._may_draft(item)
                  and (chain := forced_chain(item.seq, min(self._depth(item.seq), item.num_draft_slots)))}
        depths = self._depths(batch, chains)
        forced = {seq.seq_id: grammar_draft(seq, chains[seq.seq_id][:depth])
                  for seq, depth in depths if seq.seq_id in chains}
        self._forced = set(forced)
        for seq, depth in depths:
            if seq.seq_id in forced or not self.client.available:
                continue  # the grammar forces the next tokens: no draft-service round trip
            seqs.append(seq)  # the client sends the tokens its draft has not seen
            seed = None if seq.generator is None else draft_seed(seq.generator.initial_seed())
            requests.append(DraftRequest(seq.seq_id, seq.token_ids, draft_service_method(seq.plan), depth,
                                         min(max(seq.plan.max_nodes, depth), slots[seq.seq_id]),
                                         seq.tenant_salt, seq.span_context, seq.sampling, seed,
                                         self._take_features(seq) if self.wants_features(seq) else None))
        if not requests:
            return forced
        fitted = fit_features([r.features for r in requests], MAX_FEATURE_BYTES)
        requests = [r if r.features is f else replace(r, features=f) for r, f in zip(requests, fitted)]
        start = time.monotonic()
        result = self.client.propose(requests)
        window = (start, time.monotonic())
        fallback = result is None
        self.last_step = (window[1] - window[0], 0, 0)
        if not fallback:
            self.load.observe_draft(window[1] - window[0])
        proposals = {} if fallback else {k: v for k, v in result.items() if v is not None and v.token_ids}
        for seq in seqs:  # a constrained sequence verifies only the nodes its grammar allows
            if seq.seq_id in proposals:
                proposals[seq.seq_id] = grammar_pruned(seq, proposals[seq.seq_id])
                if not proposals[seq.seq_id].token_ids:
                    del proposals[seq.seq_id]
        for seq in seqs:
            seq.spec.draft_window = window
            if fallback or result.get(seq.seq_id) is None:
                seq.spec.fallback_steps += 1
                self._metrics.fallback(seq)
        return {**proposals, **forced}

    def verify(self, batch: list[ScheduledSeq], rows: list[torch.Tensor], trees: dict[str, DraftTree],
               deferred: set[int] | frozenset[int] = frozenset(),
               ) -> tuple[dict[str, StepResult], dict[str, Exception]]:
        """rows[i]: [num_logits, vocab] target logits of batch[i] (root + draft nodes where it
        checked a tree). For each sequence with a tree: the accepted path and bonus token
        (`accept`), the request's confidence over them, and the path's KV moved into place.
        Returns (StepResult per verified sequence, error per sequence whose verify failed: that
        request fails alone)."""
        results, failed = {}, {}
        offset = 0  # the step's logit row of item_rows[0]
        for item, item_rows in zip(batch, rows):
            seq = item.seq
            tree = trees.get(seq.seq_id)
            start, offset = offset, offset + item_rows.shape[0]
            if tree is None:
                continue
            try:
                mine = {r - start: r for r in deferred if start <= r < offset}  # local row -> step row
                path, bonus, logprobs = self.accept(seq, item_rows, tree, mine)
                if self.wants_features(seq):
                    self._committed_rows[seq.seq_id] = [0, *(node + 1 for node in path)]
                if seq.confidence is not None:
                    seq.confidence.add_tree(item_rows, tree, path, bonus)
                with self.engine_lock:
                    results[seq.seq_id] = self._compact_tree(seq, item.start, tree, path, bonus)
                    results[seq.seq_id].logprobs = logprobs
            except Exception as exc:
                log.exception("verify of %s failed", seq.seq_id)
                failed[seq.seq_id] = exc
        return results, failed

    def _compact_tree(self, seq: Sequence, context_len: int, proposal: DraftTree, path: list[int],
                      bonus: int) -> StepResult:
        """Moves the accepted path's KV into place (engine lock held); the scheduler frees the rest."""
        src = [context_len + 1 + node for node in path]
        dst = [context_len + 1 + j for j in range(len(path))]
        moves = [(a, b) for a, b in zip(src, dst) if a != b]
        if moves:
            self.runner.move_kv(seq.seq_id, [a for a, _ in moves], [b for _, b in moves])
        return StepResult([proposal.token_ids[node] for node in path] + [bonus],
                          num_computed=context_len + 1 + len(path))  # root + accepted nodes have KV

    def accept(self, seq: Sequence, rows: torch.Tensor, proposal: DraftTree,
               deferred: dict[int, int] | None = None) -> tuple[list[int], int, list | None]:
        """rows: [1 + num_nodes, vocab] target logits for root + draft nodes.

        Returns (accepted draft node indices along the path, bonus token, the committed tokens'
        TokenLogprobs from the target's rows or None when not asked for). Penalties, bias and
        min_tokens apply to every row along its own root path (logits_processors.tree_paths).
        `deferred` {row: logit row of the step}: leaf rows the forward left out (zeros until
        computed: structured/vocab_subsets.py); the one the walk ends at is computed (into `rows`,
        which the caller's confidence reads) and the bonus drawn from it, as the walk would have.
        """
        n = len(proposal.token_ids)
        raw = rows
        rows, processed = self._target_rows(seq, raw, proposal)  # masked along each node's path; processed
        dev = rows.device  # the accept kernels check that every tensor is on the logits' device
        draft_tokens = torch.tensor([[seq.token_ids[-1], *proposal.token_ids]], dtype=torch.int64, device=dev)
        parents = torch.tensor([[-1, *(p + 1 for p in proposal.parents)]], dtype=torch.int64, device=dev)
        num_nodes = torch.tensor([n + 1], dtype=torch.int64, device=dev)
        probs = None
        if seq.sampling.greedy:
            argmax = row_argmax(processed).unsqueeze(0)  # [1, n + 1]
            nodes, num_accepted, bonus = self.kernels.accept_tree_greedy(
                draft_tokens, parents, num_nodes, argmax)
        else:
            probs = target_probs(processed, seq.sampling).unsqueeze(0).contiguous()  # [1, n + 1, vocab]
            draft_probs, usable = self._draft_probs(seq, proposal, probs)  # [1, n + 1, vocab]
            if not usable:  # accept none of the tree: the bonus is sampled from the root's row
                num_nodes = torch.ones(1, dtype=torch.int64, device=dev)
            uniforms = torch.rand(1, n + 2, generator=seq.generator, device=dev)  # [1, n + 2], the generator's device
            nodes, num_accepted, bonus = self.kernels.accept_tree_sampling(
                draft_tokens, parents, num_nodes, probs, draft_probs, uniforms)
        a, bonus_token, *walk = torch.cat([num_accepted, bonus, nodes[0, 1:]]).tolist()  # one copy to the host
        path = [x - 1 for x in walk[:a]]  # draft indices
        end = path[-1] + 1 if path else 0  # the row the bonus comes from
        if deferred and end in deferred:  # a leaf: the bonus is a plain draw from its row
            with torch.inference_mode():  # the step's logits are inference tensors
                raw[end] = self.runner.deferred_logits(deferred[end]).to(raw.dtype)
                row = masked_verify_row(seq, raw[end:end + 1], proposal, end)  # [1, vocab]
                rows[end] = row[0]
                if processed is not rows:
                    paths = tree_paths(proposal.token_ids, proposal.parents)
                    processed[end] = seq.logits_processor.apply(row, seq.token_ids, [paths[end]])[0]
            if seq.sampling.greedy:
                bonus_token = int(processed[end].argmax())
            else:
                probs[0, end] = target_probs(processed[end:end + 1], seq.sampling)[0]
                draw = torch.rand(1, generator=seq.generator, device=dev)
                bonus_token = sample_inverse_cdf(probs[0, end], float(draw) * float(probs[0, end].sum()))
        seq.spec.proposed += n
        seq.spec.accepted += a
        if seq.seq_id in self._forced:
            seq.spec.forced_proposed += n
            seq.spec.forced_accepted += a
        seq.spec.verify_passes += 1
        if seq.spec.passes:  # noted by verify_span: [draft_start, draft_end, verify_start, verify_end, n, a]
            note = seq.spec.passes[-1]
            note[5] = a
            self._metrics.verify_pass(seq, n, a, note[1] - note[0], note[3] - note[2])
        logprobs = None
        if seq.sampling.logprobs:  # row of the root, then of each accepted node: they chose the tokens
            chooser = [0, *(node + 1 for node in path)]
            logprobs = token_logprobs(rows[chooser], processed[chooser],
                                      [*(proposal.token_ids[node] for node in path), bonus_token],
                                      seq.sampling, None if probs is None else probs[0, chooser])
        return path, bonus_token, logprobs

    @staticmethod
    def _target_rows(seq: Sequence, raw: torch.Tensor, proposal: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """raw: [1 + num_nodes, vocab] -> (rows masked by the grammar along each node's path,
        the same with the request's logits processors applied along each path)."""
        rows = masked_verify_rows(seq, raw, proposal)
        processed = rows if seq.logits_processor is None else seq.logits_processor.apply(
            rows, seq.token_ids, tree_paths(proposal.token_ids, proposal.parents))  # [n + 1, vocab]
        return rows, processed

    @staticmethod
    def _draft_probs(seq: Sequence, proposal: DraftTree, probs: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(q rows [1, n + 1, vocab] on the logits' device, usable): row parent(i) + 1 holds the
        draft distribution node i was sampled from; zero rows mean q = one-hot(proposed token),
        the true q of deterministic proposers (no distributions sent).

        Malformed distributions (wrong length, NaN, negative, not summing to 1, without their
        token, siblings) make the whole tree unusable: a q that cannot describe how its token
        was drawn says the draft is broken, so none of its rows is trusted and the step accepts
        none of the tree (the bonus is then a plain sample of the root's row: always lossless).
        """
        draft_probs = torch.zeros_like(probs)
        if not proposal.distributions:
            return draft_probs, True
        problem = proposal.distribution_problem(probs.shape[-1])
        if problem is not None:
            log.warning("draft distributions of %s unusable (%s): no draft accepted this step",
                        seq.seq_id, problem)
            return draft_probs, False
        dev = probs.device
        for parent, dist in zip(proposal.parents, proposal.distributions):
            ids = torch.tensor(dist.token_ids, dtype=torch.int64, device=dev)  # [k]
            q = torch.tensor(dist.probs, dtype=torch.float32, device=dev)  # [k]
            draft_probs[0, parent + 1].index_put_((ids,), q / q.sum())
        return draft_probs, True

    def release(self, seq: Sequence) -> None:
        self.features.drop(seq.seq_id)
        self._sent_end.pop(seq.seq_id, None)
        if self.prefix_features is not None:
            self.prefix_features.drop(seq.seq_id)
        if seq.plan is not None:
            self.client.release([seq.seq_id])  # no-op for sequences never sent

    @staticmethod
    def wants_features(seq: Sequence) -> bool:
        """Whether the sequence speculates with the feature head (its forward rows' features are kept)."""
        return seq.plan is not None and seq.plan.method == common_pb2.SPECULATION_METHOD_EAGLE

    def attach_prefix_features(self, store: PrefixFeatures, prefix_hashes: Callable[[str], list[int]]) -> None:
        """Keeps feature-head sequences' features of full blocks in `store`, under the hashes
        `prefix_hashes(seq_id)` (the block manager's) gives them, for later sequences' cached prefixes."""
        self.prefix_features, self._prefix_hashes = store, prefix_hashes

    def reusable_prefix(self, seq: Sequence, hashes: tuple[int, ...]) -> int:
        """How many of the cached prefix blocks `hashes` (in order) `seq` reuses: a feature-head
        sequence those whose features are kept (it recomputes the rest, so its head sees its
        whole context); any other sequence all."""
        if self.prefix_features is None or not self.wants_features(seq):
            return len(hashes)
        return self.prefix_features.held(hashes)

    def _take_features(self, seq: Sequence) -> tuple[int, torch.Tensor] | None:
        """The sequence's pending features (start, rows [m, hidden]); where they start past what
        was sent at a block boundary (a cached prefix), led by the kept features of the blocks between."""
        store, seq_id = self.prefix_features, seq.seq_id
        hashes = self._prefix_hashes(seq_id) if store is not None else []
        if store is not None:
            store.seal(seq_id, hashes)  # blocks the last step completed and the scheduler hashed
        taken = self.features.take(seq_id)
        if taken is None:
            return None
        start, rows = taken
        sent = self._sent_end.get(seq_id, 0)
        if store is not None and sent < start and sent % store.block_size == 0 and start % store.block_size == 0 \
                and len(hashes) >= start // store.block_size:
            kept = store.prefix(hashes[sent // store.block_size:start // store.block_size])  # [start - sent, hidden]
            if kept is not None:
                start, rows = sent, torch.cat([kept.to(rows.dtype), rows])
        self._sent_end[seq_id] = max(sent, start + len(rows))
        return start, rows

    def feature_seqs(self, batch: list[ScheduledSeq]) -> frozenset[str]:
        """The sequences of the step whose features the forward pass returns."""
        return frozenset(item.seq.seq_id for item in batch if self.wants_features(item.seq))

    def keep_features(self, inputs: list, features: dict[str, torch.Tensor], trees: dict[str, DraftTree]) -> None:
        """After verify: the features ([q_len, hidden] per sequence) of the rows this step committed
        go to the buffer: every row of a chunk, the root and accepted nodes of a verified tree."""
        committed, self._committed_rows = self._committed_rows, {}
        for inp in inputs:
            rows = features.get(inp.seq_id)
            if rows is None:
                continue
            if inp.seq_id in trees:
                keep = committed.get(inp.seq_id)
                if keep is None:  # its verify failed
                    continue
                rows = rows[keep]  # [1 + accepted, hidden]: at positions context_len .. after compaction
            self.features.add(inp.seq_id, inp.context_len, rows)
            if self.prefix_features is not None:
                self.prefix_features.collect(inp.seq_id, inp.context_len, rows)

    @staticmethod
    def _may_draft(item: ScheduledSeq) -> bool:
        """A decode row with a plan: it may verify a draft this step."""
        return item.seq.plan is not None and bool(item.samples) and item.num_tokens == 1

    def _depths(self, batch: list[ScheduledSeq], chains: dict[str, list[int]] | None = None,
                ) -> list[tuple[Sequence, int]]:
        """(sequence, depth >= 1) for the sequences that speculate this step. Load-aware plans
        take, each, the depth that with the others' least makes the step's rows wait per token
        (nodes ranked by their expected gain α^k), within the bounds: no seated row
        slower than plain while a request is queued for a seat, budget or blocks; the
        first-token delay of a request prefilled in the step or arriving while it runs (the
        scheduler's arrival rate) within the TTFT slack; once every seat is taken, no row's
        time per token beyond the TPOT slack (services/common/speculation_cost.LoadAwareDepth).
        `chains`: the grammar's forced tokens per constrained sequence; such a sequence drafts
        at most its chain, priced at the acceptance of its own forced drafts, and calls no draft."""
        chains = chains or {}
        fixed, aware = [], []
        plain_tokens = plain_outputs = plain_logits = prefill_tokens = 0
        for item in batch:
            seq = item.seq
            depth = min(self._depth(seq), item.num_draft_slots)
            if seq.seq_id in chains:
                depth = min(depth, len(chains[seq.seq_id]))
            if item.num_tokens != 1 or not item.samples or seq.num_output_tokens == 0:
                prefill_tokens += item.num_tokens  # a prompt chunk: its request waits for its first token
            if not self._may_draft(item) or depth < 1:
                plain_tokens += item.num_tokens
                plain_outputs += 1 if item.samples else 0
                plain_logits += 1 if item.samples else 0
            elif seq.plan.load_aware:
                aware.append((seq, depth))
            else:
                fixed.append((seq, depth))
        if not aware:
            return fixed
        alphas = [self.alpha(s, s.seq_id in chains) for s, _ in aware]
        for seq, depth in fixed:  # fixed plans are part of the step's load as asked
            plain_tokens += 1 + depth
            plain_logits += 1 + depth
            plain_outputs += expected_tokens(self.alpha(seq, seq.seq_id in chains), depth)
        depths = self.load.choose(plain_tokens, int(plain_outputs), alphas, [d for _, d in aware],
                                  prefill_tokens, plain_logits, self.arrival_rate(), len(fixed),
                                  waiting=self.queue_length(), full=self.seats_full(),
                                  draft_calls=[s.seq_id not in chains for s, _ in aware])
        return fixed + [(seq, depth) for (seq, _), depth in zip(aware, depths) if depth]

    @staticmethod
    def alpha(seq: Sequence, forced: bool = False) -> float:
        """The sequence's acceptance estimate for its next draft: its grammar's forced chains
        (`forced`) from their own counts and a high prior; the draft service's from the other
        counts and the router's predicted α."""
        spec = seq.spec
        if forced:
            return sequence_alpha(spec.forced_proposed, spec.forced_accepted, FORCED_PRIOR)
        return sequence_alpha(spec.proposed - spec.forced_proposed, spec.accepted - spec.forced_accepted,
                              seq.plan.acceptance)

    def max_draft_nodes(self, seq: Sequence) -> int:
        """The most draft nodes `seq` may propose next step (the scheduler reserves that many
        slots in the step's token budget, or fewer when the budget runs out)."""
        depth = self._depth(seq)
        return max(seq.plan.max_nodes, depth) if depth >= 1 else 0

    def _depth(self, seq: Sequence) -> int:
        """Deepest useful draft: leaves room for the bonus token within max_tokens and the context."""
        if seq.plan is None:
            return 0
        remaining = seq.sampling.max_tokens - seq.num_output_tokens
        return min(seq.plan.max_depth, remaining - 1, self.max_context - seq.num_tokens - 1)

