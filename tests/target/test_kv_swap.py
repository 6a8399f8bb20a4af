"""Swap on preemption, below the servers: the host tier's room for swapped sequences under its
byte bound, the measured-cost decision, the block manager's swap-out and resume (every block,
the partial last one included, with or without prefix caching) and the scheduler's use of them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from services.common.sampling_params import SamplingConfig
from services.target.engine.block_manager import BlockManager
from services.target.engine.host_tier import HostTier, TierIdentity
from services.target.engine.scheduler import Scheduler
from services.target.engine.sequence import Sequence
from services.target.output.detokenizer import IncrementalDetokenizer

BLOCK_BYTES = 64
IDENTITY = TierIdentity("model", "torch.float32", 4, BLOCK_BYTES)
KEY = "model\x00salt-a"


def _data(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _run_swaps(bm: BlockManager) -> dict[str, tuple[list[int], torch.Tensor | None]]:
    """What ModelRunner.move_tiers does with swaps (a block's bytes seeded by its id): copies
    out first, then back in; returns {seq id: (destination blocks, the KV copied into them)}."""
    moves = bm.take_tier_moves()
    for seq_id, block_ids in moves.swap_outs:
        moves.tier.fill_swap(seq_id, torch.stack([_data(b) for b in block_ids]))
    return {seq_id: (block_ids, moves.tier.take_swap(seq_id)) for seq_id, block_ids in moves.swap_ins}


def _measure(tier: HostTier, swap_s_per_block: float, recompute_s_per_token: float) -> None:
    """Gives the tier these measurements through the runner's own calls (one block swapped)."""
    assert tier.reserve_swap("measured", 1) and tier.fill_swap("measured", _data(0)[None])
    tier.take_swap("measured")
    tier.add_swap_time(out_s=swap_s_per_block / 2, in_s=swap_s_per_block / 2)
    tier.observe_recompute(recompute_s_per_token * 100, 100)


def test_swapped_sequences_count_against_the_byte_bound_and_prefix_entries_make_way():
    tier = HostTier(5 * BLOCK_BYTES, IDENTITY)
    for h in range(4):
        assert tier.put(h, tier.entry((None, (h,), KEY), _data(h)))
    assert tier.reserve_swap("s", 3)  # 4 + 3 > 5: the two oldest prefix entries go
    s = tier.stats()
    assert tier.hashes() == [2, 3] and (s.used_bytes, s.swap_bytes, s.dropped_blocks) == (
        5 * BLOCK_BYTES, 3 * BLOCK_BYTES, 2)
    assert not tier.reserve_swap("t", 3)  # swaps never push out swaps: no room, it recomputes
    assert tier.put(9, tier.entry((None, (9,), KEY), _data(9)))  # a prefix entry fits in what swaps leave
    assert tier.hashes() == [3, 9] and tier.stats().used_bytes == 5 * BLOCK_BYTES
    assert tier.reserve_swap("t", 2)  # takes the last prefix entries' room
    assert tier.hashes() == [] and not tier.put(10, tier.entry((None, (10,), KEY), _data(10)))
    with pytest.raises(ValueError):
        tier.reserve_swap("s", 1)
    assert not tier.fill_swap("s", torch.zeros(2, BLOCK_BYTES, dtype=torch.uint8))  # not its reserved size
    assert tier.fill_swap("s", torch.zeros(3, BLOCK_BYTES, dtype=torch.uint8))
    tier.drop_swap("s")
    assert tier.take_swap("t") is None  # reserved, never copied out: nothing to serve
    s = tier.stats()
    assert (s.used_bytes, s.swap_bytes, s.swapped_out_blocks, s.swapped_in_blocks) == (0, 0, 3, 0)


def test_swapping_pays_while_its_measured_copies_cost_less_than_recomputing_the_tokens():
    tier = HostTier(1 << 20, IDENTITY)
    assert tier.swap_pays(3, 9)  # nothing measured: swap, and so measure it
    _measure(tier, swap_s_per_block=1e-3, recompute_s_per_token=0.4e-3)
    assert tier.swap_s_per_block == pytest.approx(1e-3)
    assert tier.swap_pays(3, 9)  # 3 ms of copies against 3.6 ms of recompute
    assert not tier.swap_pays(3, 7)  # 2.8 ms: a nearly empty last block still costs a whole copy
    fallback = HostTier(1 << 20, IDENTITY)  # no swap yet: its stores and restores price the copies
    fallback.put(1, fallback.entry((None, (1,), KEY), _data(1)))
    fallback.take(1, (None, (1,), KEY))
    fallback.add_time(store_s=2e-3, restore_s=3e-3)
    assert fallback.swap_s_per_block == pytest.approx(5e-3)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_swapped_sequence_gets_its_whole_kv_back_partial_last_block_included(prefix_caching):
    tier = HostTier(1 << 20, IDENTITY)
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=prefix_caching, host_tier=tier)
    tokens = list(range(10))  # blocks of 4, 4 and 2 tokens
    bm.admit("a", bm.match_prefix(tokens, KEY), 10, 10)
    bm.commit("a", tokens, 10, KEY)
    held = bm.block_table("a")
    assert bm.swap_out("a", 10)
    assert bm.block_table("a") == [] and bm.num_free == 6 and bm.swapped_tokens("a") == 10
    assert "a" in bm.seq_ids() and tier.stats().swap_bytes == 3 * BLOCK_BYTES  # reserved before the copy
    bm.admit("b", bm.match_prefix(list(range(100, 124)), KEY), 24, 24)  # every block, a's too
    moves = bm.take_tier_moves()
    assert moves.swap_outs == [("a", held)]  # a's KV is still in place: copied out before b's forward
    for seq_id, block_ids in moves.swap_outs:
        tier.fill_swap(seq_id, torch.stack([_data(b) for b in block_ids]))
    bm.release("b")
    assert bm.can_resume(11) and not bm.has("a")
    bm.resume("a", 11)  # its swapped tokens and the next one
    table = bm.block_table("a")
    assert len(table) == 3 and bm.swapped_tokens("a") == 0
    back = _run_swaps(bm)
    assert back["a"][0] == table and torch.equal(back["a"][1], torch.stack([_data(b) for b in held]))
    s = tier.stats()
    assert (s.swap_bytes, s.swapped_out_blocks, s.swapped_in_blocks) == (0, 3, 3)
    bm.commit("a", tokens + [10], 11, KEY)
    if prefix_caching:  # its full blocks are found in the pool again
        assert bm.match_prefix(tokens, KEY).num_tokens == 8
    bm.release("a")
    assert bm.num_free == 6 and bm.seq_ids() == set()


def test_no_swap_without_room_or_while_recomputing_is_measured_cheaper():
    tier = HostTier(2 * BLOCK_BYTES, IDENTITY)
    bm = BlockManager(num_blocks=6, block_size=4, host_tier=tier)
    bm.admit("a", bm.match_prefix(list(range(10)), KEY), 10, 10)
    table = bm.block_table("a")
    assert not bm.swap_out("a", 10)  # 3 blocks, room for 2: nothing changes, the caller recomputes
    assert bm.block_table("a") == table and bm.take_tier_moves().swap_outs == []
    assert BlockManager(6, 4).swap_out("x", 1) is False  # no tier at all
    big = HostTier(1 << 20, IDENTITY)
    bm = BlockManager(num_blocks=6, block_size=4, host_tier=big)
    bm.admit("a", bm.match_prefix(list(range(10)), KEY), 10, 10)
    _measure(big, swap_s_per_block=1e-3, recompute_s_per_token=0.1e-3)  # 3 ms of copies > 1 ms recompute
    assert not bm.swap_out("a", 10) and bm.block_table("a") == table
    assert bm.swap_out("a", 10, by_cost=False)  # preemption_mode "swap": room is all it needs


def test_a_sequence_ending_while_swapped_frees_its_room_and_its_queued_copies():
    tier = HostTier(1 << 20, IDENTITY)
    bm = BlockManager(num_blocks=6, block_size=4, host_tier=tier)
    for seq_id in ("a", "b"):
        bm.admit(seq_id, bm.match_prefix(list(range(7)), KEY), 7, 7)
        assert bm.swap_out(seq_id, 7)
    bm.release("a")  # aborted before its copy-out ran
    assert [s for s, _ in bm.take_tier_moves().swap_outs] == ["b"]
    tier.fill_swap("b", torch.stack([_data(i) for i in range(2)]))
    bm.resume("b", 8)
    bm.release("b")  # ended before its copy-in ran
    moves = bm.take_tier_moves()
    assert moves.swap_ins == [] and tier.stats().swap_bytes == 0
    assert bm.num_free == 6 and bm.seq_ids() == set()


def _seq(tokenizer, name: str, prompt_len: int) -> Sequence:
    ids = list(range(5, 5 + prompt_len))
    return Sequence(name, ids, SamplingConfig(max_tokens=16), None, IncrementalDetokenizer(tokenizer, ids, ()), None)


def _step(batch) -> None:
    """As if the forward pass computed each item and sampled a token."""
    for item in batch:
        item.seq.num_computed = item.start + item.num_tokens
        item.seq.token_ids.append(7)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_scheduler_swaps_a_victim_mid_decode_and_resumes_it_where_it_was(tiny_llama_dir, mode):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    blocks = BlockManager(num_blocks=4, block_size=4, host_tier=HostTier(1 << 20, IDENTITY))
    scheduler = Scheduler(blocks, max_num_seqs=4, max_batched_tokens=64, preemption_mode=mode)
    older, younger = _seq(tokenizer, "older", 8), _seq(tokenizer, "younger", 6)
    for seq in (older, younger):
        scheduler.add(seq)
    _step(scheduler.schedule())  # both prefills: 2 blocks each, the pool is full
    # The older one's next token needs a third block: the younger one, 6 tokens computed (its
    # last block half full) and one sampled, is preempted.
    batch = scheduler.schedule()
    assert [item.seq.seq_id for item in batch] == ["older"] and younger.num_preemptions == 1
    if mode == "swap":
        assert younger.num_computed == 6 and blocks.swapped_tokens("younger") == 6
        assert scheduler.num_swap_preemptions == 1
    else:
        assert younger.num_computed == 0 and blocks.swapped_tokens("younger") == 0
        assert scheduler.num_swap_preemptions == 0
    assert scheduler.num_preemptions == 1
    moves = blocks.take_tier_moves()
    for seq_id, block_ids in moves.swap_outs:
        moves.tier.fill_swap(seq_id, torch.stack([_data(b) for b in block_ids]))
    _step(batch)
    scheduler.remove(older)
    batch = scheduler.schedule()
    item = batch[0]
    assert item.seq is younger
    if mode == "swap":  # it computes only its sampled token, on its KV copied back
        assert (item.start, item.num_tokens) == (6, 1)
        assert [s for s, _ in blocks.take_tier_moves().swap_ins] == ["younger"]
    else:  # from its first token
        assert (item.start, item.num_tokens) == (0, 7)
