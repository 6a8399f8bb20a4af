"""The scheduler owns every token of a step, draft-tree slots included, and the bookkeeping after it."""

from __future__ import annotations

import asyncio

from transformers import AutoTokenizer

from services.common.sampling_params import SamplingConfig
from services.target.engine.block_manager import BlockManager
from services.target.output.detokenizer import IncrementalDetokenizer
from services.target.engine.scheduler import Scheduler, StepResult
from services.target.engine.sequence import FinishReason, Sequence
from tests.mesh import collect, request, start_draft, start_mesh
from tests.e2e.test_generate import hf_greedy
from tests.target.test_speculation import PROMPTS


def _seq(tokenizer, name: str, prompt_len: int, max_tokens: int = 16) -> Sequence:
    ids = list(range(5, 5 + prompt_len))
    return Sequence(name, ids, SamplingConfig(max_tokens=max_tokens), None,
                    IncrementalDetokenizer(tokenizer, ids, ()), None)


def _decoding(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    """Admits `seqs` and pretends their prompts were computed and one token sampled."""
    for s in seqs:
        scheduler.add(s)
    scheduler.schedule()
    for s in seqs:
        s.num_computed = s.num_tokens
        s.token_ids.append(7)


def test_draft_slots_come_out_of_the_step_budget(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    blocks = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_batched_tokens=64, draft_limit=lambda seq: 5)
    running = [_seq(tokenizer, f"r{i}", 6) for i in range(4)]
    _decoding(scheduler, running)
    scheduler.max_batched_tokens = 12
    batch = scheduler.schedule()
    # 4 decode tokens, then the 8 left go to draft slots in order (5 + 3).
    assert [(i.seq.seq_id, i.num_tokens, i.num_draft_slots) for i in batch] == [
        ("r0", 1, 5), ("r1", 1, 3), ("r2", 1, 0), ("r3", 1, 0)]
    assert sum(i.budget_tokens for i in batch) == 12
    # Draft slots hold blocks: r0's tree is its root (index 6) and 5 nodes (7..11) = 3 blocks.
    assert len(blocks.block_table("r0")) == 3 and len(blocks.block_table("r2")) == 2


def test_a_waiting_prefill_takes_the_budget_before_draft_slots(tiny_llama_dir):
    """Speculation spends idle compute: a waiting request's prefill is admitted first (its
    TTFT), draft slots get what is left — none here, where the prefill needs it all."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    blocks = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_batched_tokens=64, draft_limit=lambda seq: 5)
    _decoding(scheduler, [_seq(tokenizer, f"r{i}", 6) for i in range(4)])
    scheduler.max_batched_tokens = 12
    scheduler.add(_seq(tokenizer, "new", 10))
    batch = scheduler.schedule()
    # 4 decode tokens, then 8 of the new prompt's 10 tokens; no draft slots this step.
    assert [(i.seq.seq_id, i.num_tokens, i.num_draft_slots) for i in batch] == [
        ("r0", 1, 0), ("r1", 1, 0), ("r2", 1, 0), ("r3", 1, 0), ("new", 8, 0)]
    assert not scheduler.waiting and len(blocks.block_table("r0")) == 2
    # A larger budget: the whole prompt first (4 + 10), the 2 left go to r0's draft slots.
    scheduler2 = Scheduler(BlockManager(num_blocks=64, block_size=4), max_num_seqs=8,
                           max_batched_tokens=64, draft_limit=lambda seq: 5)
    _decoding(scheduler2, [_seq(tokenizer, f"r{i}", 6) for i in range(4)])
    scheduler2.max_batched_tokens = 16
    scheduler2.add(_seq(tokenizer, "new", 10))
    assert [(i.seq.seq_id, i.num_tokens, i.num_draft_slots) for i in scheduler2.schedule()] == [
        ("r0", 1, 2), ("r1", 1, 0), ("r2", 1, 0), ("r3", 1, 0), ("new", 10, 0)]


def test_postprocess_keeps_the_accepted_path_and_frees_the_other_slots(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    blocks = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_batched_tokens=64, draft_limit=lambda seq: 9)
    seq, other = _seq(tokenizer, "spec", 6, max_tokens=3), _seq(tokenizer, "plain", 6)
    _decoding(scheduler, [seq, other])
    batch = scheduler.schedule()
    assert [(i.num_tokens, i.num_draft_slots) for i in batch] == [(1, 9), (1, 9)]
    assert len(blocks.block_table("spec")) == 4  # root at index 6, nodes 7..15
    # spec: 1 accepted node + bonus, and max_tokens=3 ends it after the second token;
    # plain: its proposal fell back (no tree), one sampled token.
    updates = scheduler.postprocess(batch, {"spec": StepResult([11, 12], num_computed=8),
                                            "plain": StepResult([13])}, frozenset({1}))
    assert [(u.seq.seq_id, u.token_ids, u.finish_reason) for u in updates] == [
        ("spec", [11, 12], FinishReason.LENGTH), ("plain", [13], None)]
    assert (seq.num_computed, seq.token_ids[-3:]) == (8, [7, 11, 12])
    assert (other.num_computed, other.token_ids[-2:]) == (7, [7, 13])
    assert len(blocks.block_table("spec")) == 2 and len(blocks.block_table("plain")) == 2


async def test_a_speculating_step_never_exceeds_max_batched_tokens(tiny_llama_dir):
    """Through the mesh: prompt lookup at depth 5, four requests, a 7-token budget."""
    draft = await start_draft(tiny_llama_dir)
    mesh = await start_mesh(tiny_llama_dir, draft_address=draft.address, max_batched_tokens=7,
                            speculation={"speculation_method": "prompt_lookup", "speculation_depth": 5})
    rows, trees = [], []
    forward = mesh.engine.runner.forward

    def recording_forward(inputs, **kwargs):
        rows.append(sum(len(inp.token_ids) for inp in inputs))
        trees.append(sum(inp.parents is not None for inp in inputs))
        return forward(inputs, **kwargs)
    mesh.engine.runner.forward = recording_forward
    try:
        results = await asyncio.gather(*(collect(mesh.router_stub, request(p, 24)) for p in PROMPTS))
    finally:
        await mesh.stop()
        await draft.stop(grace=0.5)
    for prompt, (ids, _, _) in zip(PROMPTS, results):
        assert ids == hf_greedy(tiny_llama_dir, prompt, 24), prompt
    assert max(rows) <= 7
    assert sum(trees) > 0, "no verify pass ran"
