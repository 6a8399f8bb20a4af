"""Runs the Hugging Face model over a flat batch of tokens against the paged KV pool
(Gemma 3 and the Llama family through their lean forwards, services/target/model/lean_forward.py)."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from services.target.model.attention import (
    AttentionMetadata,
    KVPool,
    register_paged_attention,
)
from services.target.engine.block_manager import BlockManager, TierMoves
from services.target.engine.engine_types import RankLost
from services.target.model import lean_forward
from services.target.kernels.select import get_kernels
from services.target.model.linear import prepack_linears, resolve_weight_format
from services.target.model.model_runner_inputs import StepInput
from services.target.model.output_rows import OutputRows, output_rows
from services.target.model.step_plan import BLOCKS, SLOTS, KVCopy, StepPlan, tree_mask

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to know about the loaded model."""

    num_layers: int
    num_kv_heads: int  # the KV heads this process holds: its shard's under tensor parallelism
    head_dim: int
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]


class ModelRunner:
    """Owns the model and the KV pool; one forward per engine step.

    With tensor parallelism (`tp`, services/target/tp/) the model and the pool are this rank's
    shards. Rank 0's runner holds the block manager and sends each step's plan to the other ranks;
    theirs (services/target/tp/follower.py) get only the pool's size as `block_manager` and run
    the plans they receive (`run_copies`, `execute`)."""

    def __init__(self, model, spec: ModelSpec, block_manager: BlockManager,
                 kv_dtype: torch.dtype, kernels: str = "auto", tp=None) -> None:
        self.model = model
        self.spec = spec
        self.blocks = block_manager
        self.tp = tp  # services/target/tp/group.py TensorParallel (rank 0 sends plans), or None
        self._copies: list[KVCopy] = []  # KV copies run here since the last plan went out (tp only)
        self.device = next(model.parameters()).device
        self._kernel_backend = kernels
        self.kv_pool = KVPool.allocate(spec.num_layers, block_manager.num_blocks,
                                       block_manager.block_size, spec.num_kv_heads, spec.head_dim,
                                       kv_dtype, self.device)
        # Gemma 3 and the Llama family run a lean forward with transformers' exact ops; other models their own.
        self.lean_forward = lean_forward.build(model)

    @property
    def lean_forward(self):
        return self._lean_forward

    @lean_forward.setter
    def lean_forward(self, forward) -> None:
        """The kernels are picked here, once per forward: C++ attention where its C++ row ops run."""
        self._lean_forward = forward
        self.kernels = get_kernels(self._kernel_backend, cpp_attention=getattr(forward, "row_ops", False))

    def forward(self, inputs: list[StepInput], vocab_subsets: dict[int, torch.Tensor] | None = None,
                ) -> torch.Tensor:
        """Computes and stores KV for every input token; returns logits [num_rows, vocab]
        (float32): each input's `num_logits` last rows, inputs in order. With tensor parallelism
        the step's plan goes to the other ranks first (one message), and they compute it alongside.
        `vocab_subsets` {logit row: allowed ids}: rows a grammar restricts to those ids get logits
        only there, -inf elsewhere (a lean forward on one rank; elsewhere every row is whole)."""
        return self.forward_with_features(inputs, vocab_subsets=vocab_subsets)[0]

    @torch.inference_mode()
    def forward_with_features(self, inputs: list[StepInput], feature_seqs: frozenset[str] = frozenset(),
                              vocab_subsets: dict[int, torch.Tensor] | None = None,
                              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`forward`, and for the inputs of `feature_seqs` the features of all their rows (the last
        layer's output after the final norm: [q_len, hidden] per sequence, the feature head's
        input). Only a lean forward computes features; otherwise the dict is empty."""
        plan = self.plan(inputs)
        feature_rows, offset = {}, 0
        for inp in inputs:
            if inp.seq_id in feature_seqs:
                feature_rows[inp.seq_id] = range(offset, offset + len(inp.token_ids))
            offset += len(inp.token_ids)
        start = time.perf_counter()
        if self.tp is None:
            logits, features = self._execute(plan, feature_rows, vocab_subsets)
        else:
            plan.copies, self._copies = self._copies, []  # ran here already; the other ranks run them first
            self.tp.send_step(plan.encode())
            try:
                logits, features = self._execute(plan, feature_rows)
            except RankLost:
                raise
            except Exception as exc:  # the other ranks went on with this plan: they are out of step now
                raise self.tp.lose(f"rank 0's forward failed ({type(exc).__name__}: {exc})") from exc
        tier = self.blocks.host_tier
        if tier is not None and len(plan.token_ids) >= 4 * self.blocks.block_size:  # prefill-sized: a recompute's cost
            if logits.device.type != "cpu":
                torch.cuda.synchronize(logits.device)
            tier.observe_recompute(time.perf_counter() - start, len(plan.token_ids))
        return logits, features

    def plan(self, inputs: list[StepInput]) -> StepPlan:
        """The step as host lists: the block manager's slots and block tables for each input."""
        plan = StepPlan([], [], [], [], [], [], [])
        trees = any(inp.parents is not None for inp in inputs)
        plan.parents = [] if trees else None
        for inp in inputs:
            n = len(inp.token_ids)
            plan.token_ids.extend(inp.token_ids)
            plan.positions.extend(inp.positions)
            plan.slots.extend(self.blocks.slots(inp.seq_id, inp.context_len, inp.context_len + n))
            plan.logit_rows.extend(range(len(plan.token_ids) - inp.num_logits, len(plan.token_ids)))
            plan.q_lens.append(n)
            plan.context_lens.append(inp.context_len)
            plan.block_tables.append(self.blocks.block_table(inp.seq_id))
            if trees:  # a chunk's rows as a chain: its causal mask
                plan.parents.extend(inp.parents if inp.parents is not None else range(-1, n - 1))
        return plan

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Runs one plan's forward on this rank's weights and KV shard -> logits [num_rows, vocab] f32
        (its KV copies are the caller's: `run_copies`)."""
        return self._execute(plan, {})[0]

    @torch.inference_mode()
    def _execute(self, plan: StepPlan, feature_rows: dict[str, range],
                 vocab_subsets: dict[int, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        meta = self._metadata(plan.slots, plan.positions, plan.q_lens, plan.context_lens, plan.block_tables,
                              tree_mask(plan.q_lens, plan.parents, self.device))
        # Only the plan decides (not feature_rows, rank 0's alone): every tensor-parallel rank takes the same rows.
        read = None
        if not feature_rows and getattr(self.lean_forward, "takes_output_rows", False):
            read = output_rows(plan, self._metadata, self.device)
        return self._forward(plan.token_ids, plan.positions, plan.logit_rows, meta, feature_rows, vocab_subsets, read)

    @torch.inference_mode()
    def deferred_logits(self, row: int) -> torch.Tensor:
        """The logits [vocab] float32 of logit row `row` of the last forward, which its
        vocab_subsets deferred ({row: None}: output_layer.py)."""
        return self.lean_forward.output.deferred_logits(row).float()

    @property
    def takes_vocab_subsets(self) -> bool:
        """Whether a step's forward computes grammar-restricted rows over their allowed ids only."""
        output = getattr(self.lean_forward, "output", None)
        return self.tp is None and output is not None and output.takes_subsets

    @property
    def takes_argmax_rows(self) -> bool:
        """Whether a step's forward computes rows marked ARGMAX_ONLY through the argmax screen
        (services/target/model/output_layer.py)."""
        output = getattr(self.lean_forward, "output", None)
        return self.tp is None and output is not None and output.takes_argmax_rows

    def _forward(self, ids: list[int], positions: list[int], logit_rows: list[int], meta: AttentionMetadata,
                 feature_rows: dict[str, range], vocab_subsets: dict[int, torch.Tensor] | None = None,
                 read: OutputRows | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dev = self.device
        if self.lean_forward is not None:
            args = (torch.tensor(ids, dtype=torch.long, device=dev),
                    torch.tensor(positions, dtype=torch.long, device=dev),
                    torch.tensor(logit_rows, dtype=torch.long, device=dev), meta)
            takes = self.takes_vocab_subsets or self.takes_argmax_rows
            subsets = vocab_subsets if vocab_subsets and takes else None
            if not feature_rows:
                return self.lean_forward(*args, vocab_subsets=subsets, read=read).float(), {}  # [num_rows, vocab]
            rows = torch.tensor([r for span in feature_rows.values() for r in span], dtype=torch.long, device=dev)
            logits, features = self.lean_forward(*args, feature_rows=rows, vocab_subsets=subsets)  # features [F, hidden]
            split = features.split([len(span) for span in feature_rows.values()])
            return logits.float(), dict(zip(feature_rows, split))
        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            position_ids=torch.tensor([positions], dtype=torch.long, device=dev),
            use_cache=False,
            logits_to_keep=torch.tensor(logit_rows, dtype=torch.long, device=dev),
            specmesh_meta=meta,
        )
        return out.logits[0].float(), {}  # [num_rows, vocab]; no features on this path

    def move_kv(self, seq_id: str, src: list[int], dst: list[int]) -> None:
        """Copies the KV of sequence indices `src` to indices `dst` in every layer (accepted tree paths)."""
        if src:
            self.copy_kv(KVCopy(SLOTS, self.blocks.slots_at(seq_id, src), self.blocks.slots_at(seq_id, dst)))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies whole KV blocks (source, destination) in every layer (copy-on-write); every source
        is read before any destination is written."""
        if copies:
            self.copy_kv(KVCopy(BLOCKS, [a for a, _ in copies], [b for _, b in copies]))

    def copy_kv(self, copy: KVCopy) -> None:
        """Runs one KV copy here; with tensor parallelism the next plan carries it to the other ranks."""
        self.run_copies([copy])
        if self.tp is not None:
            self._copies.append(copy)

    def run_copies(self, copies: list[KVCopy]) -> None:
        """KV copies in order, in every tensor of the pool: whole blocks, or single slots."""
        for copy in copies:
            src = torch.tensor(copy.src, dtype=torch.long, device=self.device)
            dst = torch.tensor(copy.dst, dtype=torch.long, device=self.device)
            for cache in self._caches():  # [num_blocks, block_size, ...]
                target = cache if copy.kind == BLOCKS else cache.view(-1, *cache.shape[2:])  # [num_slots, ...]
                target[dst] = target[src]

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block's KV in every layer (a host-tier entry: services/target/engine/host_tier.py)."""
        return sum(c[0].numel() * c.element_size() for c in self._caches())

    def move_tiers(self, moves: TierMoves) -> None:
        """Runs the block manager's host-tier moves: evicted blocks' and swapped sequences' KV out
        to the tier (before anything overwrites those blocks), then restored entries and resuming
        sequences' KV into their fresh blocks.

        A failed store loses only the tier copy (logged; recomputed when needed); a failed swap-out
        makes its sequence recompute when it resumes. A failed restore takes its blocks out of the
        prefix cache and fails the step's requests, as does a swap-in whose KV is missing."""
        if moves.shared is not None and moves.shares:
            self._offer_shared(moves)  # before restores: one may reuse a block whose KV is being shared
        tier = moves.tier
        if tier is None or not (moves.stores or moves.restores or moves.swap_outs or moves.swap_ins):
            return
        if moves.stores:
            start = time.perf_counter()
            try:
                rows = self._read_blocks([b for b, _, _, _ in moves.stores])  # [num_stores, block_bytes]
                for (_, h, key, first_token), row in zip(moves.stores, rows):
                    tier.store(h, key, row.clone(), first_token)  # in FP8 where the tier's precision policy says
            except Exception:
                log.exception("host tier: storing %d evicted blocks failed", len(moves.stores))
            tier.add_time(store_s=time.perf_counter() - start)
        if moves.swap_outs:
            self._swap_out(tier, moves.swap_outs)
        if moves.restores:
            start = time.perf_counter()
            try:
                self._write_blocks([b for b, _ in moves.restores], [data for _, data in moves.restores])
            except Exception:
                self.blocks.forget([b for b, _ in moves.restores])
                raise
            tier.add_time(restore_s=time.perf_counter() - start)
        if moves.swap_ins:
            start = time.perf_counter()
            for seq_id, block_ids in moves.swap_ins:
                rows = tier.take_swap(seq_id)  # [num_blocks, block_bytes]
                if rows is None or rows.shape[0] != len(block_ids):
                    raise RuntimeError(f"host tier: the swapped KV of {seq_id} is missing")
                self._write_blocks(block_ids, rows)
            tier.add_swap_time(in_s=time.perf_counter() - start)

    def _swap_out(self, tier, swap_outs: list[tuple[str, list[int]]]) -> None:
        """Copies each preempted sequence's blocks to its reserved room in the tier (one tensor per
        sequence, freed whole when it resumes)."""
        start, lost = time.perf_counter(), []
        for seq_id, block_ids in swap_outs:
            try:
                if not tier.fill_swap(seq_id, self._read_blocks(block_ids)):
                    lost.append(seq_id)
            except Exception:
                log.exception("host tier: swapping out %s (%d blocks) failed", seq_id, len(block_ids))
                lost.append(seq_id)
        tier.add_swap_time(out_s=time.perf_counter() - start)
        if lost:
            self.blocks.lose_swaps(lost)

    def _read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The KV of whole blocks in every layer as host bytes: [n, block_bytes] uint8 (a new tensor)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.cat([c[ids].reshape(len(ids), -1).view(torch.uint8) for c in self._caches()],
                         dim=1).cpu()

    def _write_blocks(self, block_ids: list[int], rows: torch.Tensor | list[torch.Tensor]) -> None:
        """Writes rows (uint8 [n, block_bytes] as `_read_blocks` gives them, or n of [block_bytes])
        into those blocks."""
        if self.device.type == "cpu":
            # Each row straight into each cache: no [n, block_bytes] staging copy, whose fresh
            # pages cost more than the copy itself (a 2,000-token restore of the default model:
            # ~36 MB; on an accelerator the staged rows are one transfer instead of n).
            caches = [c.view(c.shape[0], -1).view(torch.uint8) for c in self._caches()]  # [num_blocks, bytes]
            for block_id, row in zip(block_ids, rows):
                offset = 0
                for cache in caches:
                    cache[block_id].copy_(row[offset:offset + cache.shape[1]])
                    offset += cache.shape[1]
            return
        if isinstance(rows, list):
            rows = torch.stack(rows)  # [n, block_bytes]
        dst = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        rows, offset = rows.to(self.device), 0
        for cache in self._caches():
            width = cache[0].numel() * cache.element_size()
            chunk = rows[:, offset:offset + width].contiguous().view(cache.dtype)
            cache[dst] = chunk.view(len(dst), *cache.shape[1:])  # [n, block_size, ...]
            offset += width

    def _offer_shared(self, moves: TierMoves) -> None:
        """Copies newly committed blocks' KV out for the shared tier's writer thread (which frames
        and writes it off this thread); a full queue drops a write, never waits."""
        try:
            rows = self._read_blocks([b for b, _, _ in moves.shares])  # [num_shares, block_bytes]
            for (_, h, key), row in zip(moves.shares, rows):
                moves.shared.offer(h, key, row)
        except Exception:
            log.exception("shared tier: copying %d committed blocks out failed", len(moves.shares))

    def _caches(self) -> list[torch.Tensor]:
        """Every KV tensor of the pool, in a fixed order: [num_blocks, block_size, ...] each."""
        pool = self.kv_pool
        return [*pool.k_caches, *pool.v_caches, *(pool.k_scales or []), *(pool.v_scales or [])]

    def _metadata(self, slots: list[int], positions: list[int], q_lens: list[int],
                  ctx_lens: list[int], tables: list[list[int]],
                  tree_mask: torch.Tensor | None) -> AttentionMetadata:
        dev = self.device  # every tensor is made there from host lists: one copy each, no CPU staging tensors
        width = max(len(t) for t in tables)
        padded = [[*table, *[-1] * (width - len(table))] for table in tables]  # [num_seqs, max_blocks]
        block_tables = torch.tensor(padded, dtype=torch.int32, device=dev)
        query_start_loc = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=dev)
        return AttentionMetadata(
            kv_pool=self.kv_pool,
            kernels=self.kernels,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=block_tables,
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            query_start_loc=query_start_loc,
            query_positions=torch.tensor(positions, dtype=torch.int32, device=dev),
            tree_mask=None if tree_mask is None else tree_mask.to(dev),
        )


def load_model(model_dir: Path, dtype: torch.dtype, device: str = "cpu", weights: str = "none",
               fuse: bool = True, chat_template: str = "", tp=None):
    """Loads any local Hugging Face causal LM with paged attention; returns (model, tokenizer, spec).

    `weights` picks how linear layers are stored and multiplied (services/target/model/linear.py).
    `fuse`: the projections fused for the model's lean forward, where it has one (False:
    transformers' modules as they are, and transformers' forward).
    `tp`: this rank's shard of a tensor-parallel target (services/target/tp/shard.py), cut from
    the fused weights before packing; the spec then counts this rank's KV heads.
    """
    from services.common.models.loading import load_causal_lm

    attn = register_paged_attention()
    model, tokenizer = load_causal_lm(model_dir, dtype=dtype, device=device, attn_implementation=attn)
    model.eval()
    from services.common.models.chat_templates import apply_chat_template_setting
    log.info("chat template: %s", apply_chat_template_setting(tokenizer, chat_template))  # before the spec's end of turn
    spec = model_spec(model, tokenizer)
    if fuse:
        lean_forward.fuse(model)  # before packing: the fused weights get packed
    if tp is not None and tp.world > 1:
        from services.target.tp.shard import shard_model
        shard_model(model, tp)
        spec = replace(spec, num_kv_heads=spec.num_kv_heads // tp.world)
    from services.common.models.prepare import source_gguf
    gguf_source = source_gguf(model_dir) if tp is None or tp.world == 1 else None  # blocks are not sharded
    weight_format = resolve_weight_format(weights, dtype, device, gguf_source)
    packed = prepack_linears(model, weight_format, gguf_source)
    log.info("linear layers: %s (asked: %s), %d packed", weight_format, weights, packed)
    return model, tokenizer, spec


def model_spec(model, tokenizer) -> ModelSpec:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "attn_logit_softcapping", None):
        # Checked once here so no request ever reaches a layer that would need it.
        raise ValueError(f"{config.model_type} uses attention logit soft-capping "
                         f"({config.attn_logit_softcapping}), which specmesh's paged attention does not "
                         "implement; serve a model without it (e.g. Gemma 3 instead of Gemma 2)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    eos: set[int] = set()
    # Same precedence as transformers' generate: generation config first.
    for source in (getattr(model, "generation_config", None), config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            eos.update([value] if isinstance(value, int) else value)
            break
    from services.common.models.chat_templates import end_of_turn_ids
    eos |= end_of_turn_ids(tokenizer)  # chat answers end there (Gemma's <end_of_turn>)
    return ModelSpec(
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_context=config.max_position_embeddings,
        eos_token_ids=frozenset(eos),
    )
